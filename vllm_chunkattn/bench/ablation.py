"""`python -m vllm_chunkattn.bench ablation`: where CUSTOM's serving cost comes from.

Every variant is a vLLM server (stock, CUSTOM, CUSTOM with one suspect switched off, CUSTOM as
built at an earlier commit); all are started first and stay up, then one workload runs on each
in turn, in ABBA order (reversed every round; with three or more variants also rotated), for
--repeats rounds, through vLLM's own benchmark client (`bench ab`'s run_workload). Only one
server works at a time; idle ones sleep. Report: median and spread of output tok/s and mean
TPOT per variant, and each one's ratio to stock (of the medians, and each round's), in CSV +
markdown.

    python -m vllm_chunkattn.bench ablation --workload shared0 --repeats 3
    python -m vllm_chunkattn.bench ablation --baseline 8c222fc     # adds CUSTOM at that commit
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_chunkattn.bench import provenance
from vllm_chunkattn.bench.ab import TINY_SERVER_ARGS, run_workload
from vllm_chunkattn.bench.ab_workloads import full_workloads
from vllm_chunkattn.bench.server_client import SERVED_NAME, kv_capacity_tokens, log, tiny_request
from vllm_chunkattn.bench.model_shapes import has_weights
from vllm_chunkattn.bench.server_process import ServerProcess

CUSTOM = ["--attention-backend", "CUSTOM"]
SETTLE_S = 2.0       # between runs: the last server's busy-poll tail (1 s) is over
# name -> (extra server flags, extra environment, what it switches off)
VARIANTS = {
    "stock": ([], {}, "vLLM's own attention and KV cache manager"),
    "custom": (CUSTOM, {}, "the flag as shipped"),
    "custom-vllm-kv-manager": (CUSTOM, {"CHUNKATTN_TREE_KV_MANAGER": "0"},
                               "vLLM's KVCacheManager instead of the chunk tree (TPP decode kept)"),
    "custom-fcfs": (CUSTOM, {"CHUNKATTN_PREFIX_AWARE_SCHEDULING": "0"},
                    "prefix-aware admission off (FCFS)"),
    "custom-plan-every-step": (CUSTOM, {"CHUNKATTN_PLAN_CACHE": "0"},
                               "plan rebuilt every step (no lazy reuse)"),
    "custom-omp-passive": (CUSTOM, {"OMP_WAIT_POLICY": "passive"},
                           "OpenMP threads sleep instead of spinning between regions"),
    "stock-omp-passive": ([], {"OMP_WAIT_POLICY": "passive"}, "stock, same OpenMP setting"),
}


def baseline_tree(rev: str, tmp: Path) -> Path:
    """A worktree of this repo at `rev` with its extension built (copied from this checkout
    when csrc/ and setup.py are the same at `rev`): its package shadows ours (PYTHONPATH) in that
    variant's server."""
    root = Path(__file__).resolve().parents[2]
    dest = tmp / f"baseline-{rev}"
    if not dest.exists():
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(dest), rev],
                       check=True, capture_output=True)
    built = sorted((root / "vllm_chunkattn").glob("_C*.so"))
    same_kernels = subprocess.run(["git", "-C", str(root), "diff", "--quiet", rev, "--", "csrc",
                                   "setup.py"]).returncode == 0
    if built and same_kernels:       # the kernels are this checkout's: its build serves
        for so in built:
            shutil.copy2(so, dest / "vllm_chunkattn" / so.name)
    else:
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=dest,
                       check=True, capture_output=True)
    return dest


def round_order(variants: list[str], r: int) -> list[str]:
    """Round r's order: reversed every round (ABBA), and with more than two variants rotated
    every two rounds, so that over 2 x len(variants) rounds each variant runs in every position
    (first, in the middle, last) equally often: a position's cost (the run right after another
    server's) then falls on no variant more than on another."""
    k = (r // 2) % len(variants) if len(variants) > 2 else 0
    order = variants[k:] + variants[:k]
    return order if r % 2 == 0 else order[::-1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench ablation",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="local model dir (default: the tiny model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--workload", default="shared0", help="a `bench ab` workload name")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--baseline", default=None, help="git revision: adds CUSTOM built at it")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="cpu")
    a = p.parse_args(argv)
    variants = {v: VARIANTS[v] for v in a.variants.split(",")}
    workload = next(w for w in full_workloads() if w.name == a.workload)
    os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
    from vllm_chunkattn.tiny_model import ensure_tiny_model
    model = a.model or str(ensure_tiny_model())
    common = shlex.split(TINY_SERVER_ARGS.format(kv_bytes=a.kv_cache_bytes, dtype=a.dtype))
    common += ["--served-model-name", SERVED_NAME]
    if not has_weights(model):
        common += ["--load-format", "dummy"]          # a model_shapes config: no weights
    tmp = Path(tempfile.mkdtemp(prefix="chunkattn-ablation-"))
    if a.baseline:
        src = baseline_tree(a.baseline, tmp)
        variants[f"custom@{a.baseline}"] = (CUSTOM, {"PYTHONPATH": str(src)},
                                            f"CUSTOM as built at commit {a.baseline}")
    command = "python -m vllm_chunkattn.bench ablation " + shlex.join(
        sys.argv[2:] if argv is None else argv)
    load_before = provenance.load_average()
    servers: dict[str, ServerProcess] = {}
    results: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        for name, (flags, env, _) in variants.items():
            log(f"ablation: starting {name}")
            s = ServerProcess(model, common + flags, env={"VLLM_SERVER_DEV_MODE": "1", **env},
                              log_path=tmp / f"{name}.server.log")
            servers[name] = s
            s.start()
            tiny_request(s)
        kv_tokens = {n: kv_capacity_tokens(s.url) for n, s in servers.items()}
        for r in range(a.repeats):
            for name in round_order(list(variants), r):
                # A server that just answered busy-polls its worker queue for vLLM's shared
                # memory MessageQueue busy_loop_s (1 s) before sleeping; starting the next run
                # within it would hand that run a second of a spinning core.
                time.sleep(SETTLE_S)
                row = run_workload(servers[name], name, workload, model, tmp, 600, None,
                                   kv_tokens[name])
                results[name].append(row)
                log(f"round {r + 1} {name}: {row.get('output_tok_s', 0):.0f} tok/s, TPOT "
                    f"{row.get('mean_tpot_ms', float('nan')):.1f} ms ({row['status']})")
    finally:
        for s in servers.values():
            s.stop()
        if a.baseline:                       # the worktree is registered in this repo: unregister
            subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[2]), "worktree",
                            "remove", "--force", str(src)], capture_output=True)
    write_report(results, variants, a, command, model, load_before)
    return 0


def write_report(results, variants, a, command, model, load_before) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"ablation_{a.tag}"
    rows = []
    for name, runs in results.items():
        ok = [r for r in runs if r["status"] == "ok"]
        tok = [r["output_tok_s"] for r in ok]
        tpot = [r["mean_tpot_ms"] for r in ok]
        rows.append({"variant": name, "switches off": variants[name][2], "runs": len(ok),
                     "tok_s_median": statistics.median(tok) if tok else float("nan"),
                     "tok_s_min": min(tok, default=float("nan")),
                     "tok_s_max": max(tok, default=float("nan")),
                     "tpot_ms_median": statistics.median(tpot) if tpot else float("nan"),
                     "others_cpu_pct_max": max((r["others_cpu_pct"] for r in ok), default=0)})
    stock = next((r for r in rows if r["variant"] == "stock"), None)
    for r in rows:
        r["vs_stock"] = r["tok_s_median"] / stock["tok_s_median"] if stock else float("nan")
        # Each round's ratio to stock's run of the same round (adjacent in the ABBA order): the
        # machine's drift between rounds cancels.
        pairs = [(v["output_tok_s"], s["output_tok_s"]) for v, s in
                 zip(results[r["variant"]], results.get("stock", []))
                 if v["status"] == "ok" and s["status"] == "ok"]
        ratios = sorted(v / s for v, s in pairs)
        r["round_ratios"] = " ".join(f"{x:.3f}" for x in ratios)
        r["round_ratio_median"] = statistics.median(ratios) if ratios else float("nan")
    cols = list(rows[0])
    (out / f"{stem}.csv").write_text("\n".join(
        [",".join(cols)] + [",".join(str(r[c]).replace(",", ";") for c in cols) for r in rows])
        + "\n")
    fmt = {"tok_s_median": "{:.0f}", "tok_s_min": "{:.0f}", "tok_s_max": "{:.0f}",
           "tpot_ms_median": "{:.1f}", "vs_stock": "{:.2f}x",
           "round_ratio_median": "{:.3f}x"}
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    table += ["| " + " | ".join(fmt.get(c, "{}").format(r[c]) for c in cols) + " |" for r in rows]
    lines = [f"# Ablation: what CUSTOM costs in serving ({a.tag})", "",
             f"Command: `{command}`", "",
             f"- machine: {provenance.machine()}; load average before {load_before}, after "
             f"{provenance.load_average()}",
             f"- model: `{model}`, {a.dtype}; server flags `{TINY_SERVER_ARGS.format(kv_bytes=a.kv_cache_bytes, dtype=a.dtype)}`",
             f"- workload `{a.workload}` (`bench ab`'s, through `vllm bench serve`), "
             f"{a.repeats} rounds, the variants' order reversed every round (ABBA) and, with "
             f"more than two, rotated every two rounds; {SETTLE_S:g} s between runs (past the "
             f"last server's 1 s busy-poll); all servers "
             f"up for the whole run, one working at a time; commit {provenance.git_commit()}, "
             f"{time.strftime('%Y-%m-%d %H:%M')}",
             "- tok/s = the client's output throughput; TPOT = mean over requests; vs_stock = "
             "the medians' ratio; round_ratios = each round's tok/s over stock's in that round, "
             "sorted, and their median", "",
             *table, ""]
    (out / f"{stem}.md").write_text("\n".join(lines))
    plot_round_ratios(rows, f"{a.tag}\n{a.workload}: output tok/s over stock's, per round",
                      out / f"{stem}.png")
    log(f"ablation: report {out / stem}.md")


def plot_round_ratios(rows: list[dict], title: str, path: Path) -> None:
    """Each variant's per-round ratios to stock (dots) and their median (bar)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("ablation: matplotlib not installed: no plot")
        return
    from vllm_chunkattn.bench.ab_report import _save
    shown = [r for r in rows if r["variant"] != "stock" and r["round_ratios"]]
    fig, ax = plt.subplots(figsize=(2.6 + 1.4 * len(shown), 3.8))
    for i, r in enumerate(shown):
        ratios = [float(x) for x in r["round_ratios"].split()]
        ax.plot([i] * len(ratios), ratios, "o", alpha=0.6)
        ax.hlines(r["round_ratio_median"], i - 0.3, i + 0.3, colors="k")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(shown)), [r["variant"] for r in shown])
    ax.set_xlim(-0.6, len(shown) - 0.4)
    ax.set_ylabel("tok/s / stock's, same round")
    ax.set_title(title, fontsize=9)
    _save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
