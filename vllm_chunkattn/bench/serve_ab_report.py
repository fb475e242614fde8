"""python -m vllm_chunkattn.bench.serve_ab_report --tag TAG --out DIR RUN_DIR [RUN_DIR ...]

The report of the GPU serving A/B from the files benchmarks/gpu/serve_ab.sh's runs leave (each
RUN_DIR: one run's files, results_<system>-r<round>.tar.gz and server_<...>.log):
ab_<TAG>.{md,csv,png} as `bench ab` writes them (ab_report.py), with the GPU goals, plus
ab_<TAG>_rounds.csv with every round. Rounds of one system and workload (ABBA) are combined by
their median; a round that lost requests is reported, not combined.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import re
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path

from . import ab_report, serve_steps, serve_waves
from .serve_metrics import (ENGINE_TTFT_PARTS, LOAD, engine_itl_ms, histogram_mean_ms,
                            load_while_serving, peaks, samples, shared_kv_read_pct)
from .server_client import latency_metrics

# serve_ab.sh's workloads: what each shares (ab_report's columns).
WORKLOADS = {
    "random": dict(group="shared", shared_len=0, num_prefixes=0, n=1),
    "prefix1x2k": dict(group="shared", shared_len=2048, num_prefixes=1, n=1),
    "prefix1x2k_c128": dict(group="shared", shared_len=2048, num_prefixes=1, n=1),
    "prefix1x2k_c256": dict(group="shared", shared_len=2048, num_prefixes=1, n=1),
    "prefix4x2k": dict(group="shared", shared_len=2048, num_prefixes=4, n=1),
    "n8x1k": dict(group="samples", shared_len=1024, num_prefixes=16, n=8),
    "tree": dict(group="tree", shared_len=1024, num_prefixes=1, n=1),
}
# The GPU goals: >= 1.6x output tok/s with 2K shared, >= 0.98x with nothing shared, peak KV no worse
# than stock with prefix caching.
GPU_GOALS = {"speedup": ((2048, 1.6), (0, 0.98)), "kv_vs_stock": 0.0}
NUMERIC = ("completed", "failed", "duration_s", "output_tok_s", "mean_ttft_ms", "mean_tpot_ms",
           "p99_tpot_ms", "norm_latency_ms", "p99_norm_latency_ms", "peak_kv_usage_pct",
           "peak_kv_tokens", "peak_running", "shared_kv_read_pct", "tokens_per_message",
           "longest_silence_s", "api_server_cpu_pct", "client_cpu_pct", "engine_core_cpu_pct",
           "gpu_busy_pct", "gpu_idle_pct", "engine_itl_ms", "engine_queue_ms", "engine_prefill_ms",
           "ttft_outside_engine_ms",
           "kv_bound_tokens", "steps", "mean_step_ms", "decode_wait_ms", "step_peak_kv_tokens")
INTEGER = ("completed", "failed", "peak_kv_tokens", "peak_running", "steps", "step_peak_kv_tokens")
TAG_RE = re.compile(r"results_(stock|custom)-r(\d+)\.tar\.gz$")


def kv_capacity_tokens(server_log: str) -> int:
    """vLLM's "GPU KV cache size: 1,234 tokens" line, or 0."""
    m = re.search(r"KV cache size: ([\d,]+) tokens", server_log)
    return int(m.group(1).replace(",", "")) if m else 0


def tokens_per_message(res: dict) -> float:
    """Output tokens per streamed message (`vllm bench serve --save-detailed`: a request's
    messages are its first token + one per inter-token gap): ~1 when every step's token is
    sent as it comes, more when the server sends them in bursts."""
    itls = res.get("itls") or []
    messages = sum(len(gaps) + 1 for gaps in itls)
    return sum(res.get("output_lens") or []) / messages if messages else math.nan


BLOCK = 16    # vLLM's KV block on CUDA, stock and CUSTOM alike (CUSTOM's log: chunk size=16)


def kv_bound_tokens(res: dict, shape: dict, block: int = BLOCK) -> float:
    """The most KV tokens a workload's running rows can hold at once, for either system: its
    max_concurrency largest requests at full length (prompt + outputs - 1 written), each prefix's
    full blocks once. The peaks sampled every 0.25 s fall under it by however much the rows grew
    since the last sample; nan where a request is several sequences (n > 1) or a tree."""
    if shape["n"] != 1 or shape["group"] == "tree" or not res.get("input_lens"):
        return math.nan
    shared = shape["shared_len"] // block * block
    private = sorted((-(-max(0, i - shared + o - 1) // block) for i, o in
                      zip(res["input_lens"], res.get("output_lens") or [])), reverse=True)
    running = res.get("max_concurrency") or len(private)
    return block * (shape["num_prefixes"] * (shared // block) + sum(private[:running]))


def longest_silence_s(res: dict) -> float:
    """The longest time between two messages of any streams (first token + inter-token gaps
    from each request's start): a server or client that stalls as a whole shows here, where
    per-request merging alone would not (1.29 s on an H100, CUSTOM's bursty run)."""
    times = []
    for start, ttft, gaps in zip(res.get("start_times") or [], res.get("ttfts") or [],
                                 res.get("itls") or []):
        t = start + ttft
        times.append(t)
        for gap in gaps:
            t += gap
            times.append(t)
    times.sort()
    return max((b - a for a, b in zip(times, times[1:])), default=math.nan)


def run_name(name: str, rnd: int, names) -> str:
    """A workload's name in its server's log marks and load samples: `serve_ab.sh pair` runs two
    rounds on one server and names them <workload>-r<round>; one round a server, <workload>."""
    return f"{name}-r{rnd}" if f"{name}-r{rnd}" in names else name


def read_run(run: Path, system: str, rnd: int, server_log: str) -> list[dict]:
    """One system's rows (a row per workload) from one serve_ab.sh run's work folder."""
    capacity = kv_capacity_tokens(server_log)
    kv_tsv = (run / "kv.tsv").read_text() if (run / "kv.tsv").exists() else ""
    sampled = samples(kv_tsv)
    kv, load = peaks(sampled), load_while_serving(kv_tsv)
    steps = serve_steps.workload_steps(server_log)
    names = {*steps, *(w for w, _ in sampled)}
    rows = []
    for workload, shape in WORKLOADS.items():
        result = run / f"{workload}.json"
        if not result.exists():
            continue
        res = json.loads(result.read_text())
        name = run_name(workload, rnd, names)
        row = dict(system=system, round=rnd, workload=workload, **shape,
                   request_rate=float("inf"), num_prompts=res.get("num_prompts", 0))
        row.update(latency_metrics(res, shape["n"]))
        usage = kv.get((name, "vllm:kv_cache_usage_perc"), 0.0)
        row.update(peak_kv_usage_pct=100 * usage, peak_kv_tokens=round(usage * capacity),
                   peak_running=int(kv.get((name, "vllm:num_requests_running"), 0)),
                   status="ok" if not row["failed"] else f"{row['failed']} requests failed")
        row.update(tokens_per_message=tokens_per_message(res),
                   longest_silence_s=longest_silence_s(res),
                   kv_bound_tokens=kv_bound_tokens(res, shape),
                   **serve_steps.step_stats(steps.get(name, []), res.get("duration", 0), capacity))
        for key in (*LOAD, "gpu_idle_pct"):
            row[key] = load.get((name, key), math.nan)
        counters = run / f"{workload}.counters"
        text = counters.read_text() if counters.exists() else ""
        row.update(shared_kv_read_pct=shared_kv_read_pct(text), engine_itl_ms=engine_itl_ms(text),
                   **{k: histogram_mean_ms(text, m) for k, m in ENGINE_TTFT_PARTS.items()})
        # The client's TTFT less the engine's parts: HTTP, tokenization and the API servers.
        row.update(ttft_outside_engine_ms=row["mean_ttft_ms"] - sum(row[k] for k in ENGINE_TTFT_PARTS),
                   waves=serve_waves.waves(res))
        rows.append(row)
    return rows


def server_log(path: Path) -> str:
    """A server's log as serve_ab.sh left it, or gzipped as committed (path + .gz); "" if none."""
    if path.exists():
        return path.read_text(errors="replace")
    gz = path.with_name(path.name + ".gz")
    return gzip.decompress(gz.read_bytes()).decode(errors="replace") if gz.exists() else ""


def run_log(tarball: Path) -> str:
    """The server log beside a run's results_<system>-r<round>.tar.gz: the round's own, or the
    system's, which a pair's two rounds share (serve_ab.sh)."""
    system, rnd = TAG_RE.search(tarball.name).groups()
    return (server_log(tarball.with_name(f"server_{system}-r{rnd}.log"))
            or server_log(tarball.with_name(f"server_{system}.log")))


def read_results(tarball: Path, work: Path) -> list[dict]:
    """read_run over one serve_ab.sh run's files (results tarball + server log)."""
    system, rnd = TAG_RE.search(tarball.name).groups()
    dest = work / f"{system}-r{rnd}"
    with tarfile.open(tarball) as t:
        t.extractall(dest, filter="data")
    return read_run(dest, system, int(rnd), run_log(tarball))


def summary(run: Path, server_log: Path, tag: str) -> str:
    """serve_ab.sh's per-run table (on the GPU machine, beside the run): the report's
    columns for one run."""
    system, rnd = tag.rsplit("-r", 1)
    rows = read_run(run, system, int(rnd), server_log.read_text(errors="replace"))
    lines = [f"# {tag}: vllm serve, vllm bench serve (TPOT per sequence)", "",
             "| workload | completed | output tok/s | mean TPOT ms | p99 TPOT ms | mean TTFT ms "
             "| peak KV % | peak running | shared KV reads % | tokens / message | API server CPU % "
             "| client CPU % | engine core CPU % | GPU busy % | mean step ms | decode-step wait ms "
             "| peak KV per step | engine ITL ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['completed']} | {r['output_tok_s']:.1f} "
              f"| {r['mean_tpot_ms']:.2f} | {r['p99_tpot_ms']:.2f} | {r['mean_ttft_ms']:.1f} "
              f"| {r['peak_kv_usage_pct']:.1f} | {r['peak_running']} "
              f"| {r['shared_kv_read_pct']:.1f} | {r['tokens_per_message']:.1f} "
              f"| {r['api_server_cpu_pct']:.0f} | {r['client_cpu_pct']:.0f} "
              f"| {r['engine_core_cpu_pct']:.0f} "
              f"| {r['gpu_busy_pct']:.0f} | {r['mean_step_ms']:.2f} | {r['decode_wait_ms']:.2f} "
              f"| {ab_report._f(r['step_peak_kv_tokens'], 0)} | {r['engine_itl_ms']:.2f} |"
              for r in rows]
    return "\n".join(lines)


def combine(rounds: list[dict]) -> list[dict]:
    """One row per (system, workload): the median of its rounds that completed (of each number,
    over the rounds that have it)."""
    out = []
    keys = list(dict.fromkeys((r["system"], r["workload"]) for r in rounds))
    for system, workload in keys:
        mine = [r for r in rounds if (r["system"], r["workload"]) == (system, workload)]
        ok = [r for r in mine if r["status"] == "ok"]
        row = dict(mine[0])
        row.pop("round")
        if not ok:
            out.append(row)
            continue
        for k in NUMERIC:     # over the rounds that measured it (a round may predate a sample)
            seen = [r[k] for r in ok if not math.isnan(r[k])]
            row[k] = statistics.median(seen) if seen else math.nan
            if k in INTEGER and seen:
                row[k] = round(row[k])
        row["status"] = "ok"
        row["rounds"] = len(ok)
        out.append(row)
    return out


STREAM_COLUMNS = {"engine_itl_ms": "engine ITL ms", "engine_queue_ms": "engine queue ms",
                  "engine_prefill_ms": "engine prefill ms",
                  "ttft_outside_engine_ms": "TTFT outside the engine ms",
                  "tokens_per_message": "tokens / message", "longest_silence_s": "longest silence s",
                  "api_server_cpu_pct": "API server CPU %", "client_cpu_pct": "client CPU %",
                  "engine_core_cpu_pct": "engine core CPU %", "gpu_busy_pct": "GPU busy %",
                  "gpu_idle_pct": "GPU idle samples %"}


def streaming_section(rows: list[dict], systems: list[str]) -> str:
    """How the tokens reached the client and what each step waited on: a server that falls
    behind merges a request's tokens into fewer, larger messages (ITL then measures the API
    server, not the engine); a GPU idle between steps while the engine core works says the
    steps wait for the host. Columns no run sampled (rounds before the sampler had them) are
    left out."""
    idx = {(r["system"], r["workload"]): r for r in rows}
    keys = [k for k in STREAM_COLUMNS
            if any(not math.isnan(r.get(k, math.nan)) for r in rows)]
    head = ["workload", *(f"{s} {STREAM_COLUMNS[k]}" for k in keys for s in systems)]
    body = [[w, *(ab_report._f(idx.get((s, w), {}).get(k), 2 if k == "longest_silence_s" else 1)
                  for k in keys for s in systems)]
            for w in dict.fromkeys(r["workload"] for r in rows)]
    # The engine's own speed-up: where the front end caps what reaches the client, output tok/s
    # and TPOT compare front ends, this compares the engines.
    if "engine_itl_ms" in keys and {"stock", "custom"} <= set(systems):
        head.append("engine speed-up (stock / custom ITL)")
        for line in body:
            stock, custom = (idx.get((s, line[0]), {}).get("engine_itl_ms", math.nan)
                             for s in ("stock", "custom"))
            line.append(ab_report._f(stock / custom if custom > 0 else math.nan, 2))
    return "\n".join(["", "## Streaming and load: tokens per stream message, CPU, GPU busy", "",
                      "Engine ITL = the mean of vLLM's `vllm:inter_token_latency_seconds` over the "
                      "run (from its counters read before and after): each token timed by the "
                      "engine core's output timestamps, so a front end that falls behind does not "
                      "lengthen it as it does the client's TPOT; the engine speed-up is stock's "
                      "over CUSTOM's. Engine queue / prefill = the means of "
                      "`vllm:request_queue_time_seconds` (arrival at the engine to first "
                      "scheduled) and `vllm:request_prefill_time_seconds` (then to the first "
                      "token), the engine's parts of TTFT; TTFT outside the engine = the mean "
                      "TTFT less both (HTTP, tokenization, the API servers' hand-over). Tokens per message = a workload's output tokens / the stream messages its "
                      "requests got (first token + one per inter-token gap in `--save-detailed`); "
                      "longest silence = the longest time no stream got a message (prefill "
                      "included; the whole server or client stalling); API server / client / "
                      "engine core CPU = the busiest API server process's (the `vllm serve` "
                      "process, or one of its --api-server-count children), the `vllm bench "
                      "serve` process's and the EngineCore's CPU use (100 = one core: a GIL-bound "
                      "process near 100 is saturated; the engine core also spins while it waits "
                      "for the GPU); GPU busy = NVML's share of time with a kernel running; each "
                      "the mean of the samples (every 0.25 s) taken while requests were running; "
                      "GPU idle samples = the share of those samples with GPU busy 0 (no kernel "
                      "in the sample's whole period).",
                      "",
                      ab_report._table(head, body)]) + "\n"


def kv_bound_section(rows: list[dict], systems: list[str]) -> str:
    """Each system's sampled peak KV beside the most the workload can hold: a difference between
    the systems smaller than their distance to the bound is where the samples fell."""
    idx = {(r["system"], r["workload"]): r for r in rows}
    body = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        bound = next((idx[(s, w)]["kv_bound_tokens"] for s in systems if (s, w) in idx), math.nan)
        if math.isnan(bound):
            continue
        body.append([w, ab_report._f(bound, 0), *(
            "–" if (s, w) not in idx else serve_steps.of_bound(idx[(s, w)]["peak_kv_tokens"], bound)
            for s in systems)])
    if not body:
        return ""
    return "\n".join(["", "## Peak KV samples against the workload's bound", "",
                      "Bound = the KV tokens the workload's running rows hold at most: its "
                      "max-concurrency largest requests at full length (prompt + output - 1 "
                      f"tokens in blocks of {BLOCK}), each shared prefix's full blocks once; the "
                      "same for both systems.", "",
                      ab_report._table(["workload", "bound tokens",
                                        *(f"{s} sampled peak (% of bound)" for s in systems)],
                                       body)]) + "\n"


def _setup_text(work: Path, pattern: str) -> str:
    for p in sorted(work.glob(pattern)):
        return p.read_text().strip()
    return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", type=Path, help="folders of serve_ab.sh runs' files")
    ap.add_argument("--tag")
    ap.add_argument("--summary", nargs=3, metavar=("RUN_DIR", "SERVER_LOG", "SYSTEM-rROUND"),
                    help="print one run's table instead (serve_ab.sh, on the GPU machine)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--commit", default="?", help="the commit the GPU machine ran")
    a = ap.parse_args(argv)
    if a.summary:
        run, log, tag = a.summary
        print(summary(Path(run), Path(log), tag))
        return 0
    if not a.runs or not a.tag:
        ap.error("give --tag and the run folders (or --summary)")
    tarballs = sorted(p for d in a.runs for p in d.glob("results_*-r*.tar.gz"))
    if not tarballs:
        print("serve_ab_report: no results_<system>-r<round>.tar.gz in the given folders")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rounds = [r for t in tarballs for r in read_results(t, work)]
        server_cmd = _setup_text(work, "stock-r*/server_cmd.txt")
        gpu = _setup_text(work, "*/gpu.txt")
        flags = {w: _setup_text(work, f"*/{w}.flags") for w in WORKLOADS}
    logs = "".join(run_log(t) for t in tarballs if TAG_RE.search(t.name).group(1) == "custom")
    kernel = re.search(r"kernel=(\S+?),", logs)
    graphs = sorted(set(re.findall(r"Capturing CUDA graphs \(([^)]*)\)", logs)))
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / f"ab_{a.tag}_rounds.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, ["system", "round", "workload", "status", *NUMERIC],
                            extrasaction="ignore")
        wr.writeheader()
        wr.writerows(rounds)
    rows = combine(rounds)
    prompts = {r["workload"]: r["num_prompts"] for r in rounds}
    systems = [s for s in ("stock", "custom") if any(r["system"] == s for r in rows)]
    words = server_cmd.split()
    model = words[2] if len(words) > 2 else "?"
    if "--load-format dummy" in server_cmd:
        model += " (dummy weights: a config and a tokenizer, e.g. model_shapes.py llama-3-8b)"
    setup = {"model": model,
             "server_args": re.sub(r" --port \d+", "", server_cmd), "systems": systems, "commit": a.commit,
             "date": "see the runs' server logs", "native": kernel.group(1) if kernel else "?",
             "machine": f"{gpu}; CUSTOM graphs captured: {', '.join(graphs) or 'none seen'}; "
                        f"rounds per system: "
                        + ", ".join(f"{s} {len({r['round'] for r in rounds if r['system'] == s})}"
                                    for s in systems),
             "time_limit_min": 0, "slo_ms": float("inf"), "goals": GPU_GOALS, "sample_s": 0.25,
             "client": "`vllm bench serve` from benchmarks/gpu/serve_ab.sh (`--ignore-eos "
                       "--seed 0 --save-detailed`, 32 concurrent; prefix1x2k_c128 / _c256: "
                       "128 / 256 concurrent; n8x1k: n = 8 at temperature 1, 4 concurrent); a server "
                       "per system runs its rounds' workloads in turn (one round a server, or two in "
                       "`serve_ab.sh pair`: both servers up, each workload stock, custom, custom, "
                       "stock, the second round with `--seed 1`, other prompts), no prefix-cache "
                       "reset between them (their prompts share nothing)",
             "workloads": [(w, prompts.get(w, ""), float("inf"), flags[w]) for w in WORKLOADS
                           if flags[w] != "?"]}
    paths = ab_report.write(rows, setup, a.out, a.tag)
    with open(a.out / f"ab_{a.tag}.md", "a") as f:
        f.write(streaming_section(rows, systems) + kv_bound_section(rows, systems)
                + serve_steps.steps_section(rows, systems, GPU_GOALS["kv_vs_stock"])
                + serve_waves.section(rounds, systems))
    print("serve_ab_report:", ", ".join(str(p) for p in [a.out / f"ab_{a.tag}_rounds.csv", *paths]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
