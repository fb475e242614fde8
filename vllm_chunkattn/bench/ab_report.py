"""The A/B report: ab_<tag>.csv (every run), ab_<tag>.md (tables like the paper's Table 4, the
memory comparison, the rate sweep, the goals) and PNG plots (normalised latency vs request rate
like the paper's Fig. 5; output throughput per workload)."""
from __future__ import annotations

import csv
import math
from pathlib import Path

COLUMNS = ["system", "workload", "group", "shared_len", "num_prefixes", "n", "request_rate",
           "num_prompts", "status", "completed", "failed", "duration_s", "output_tok_s",
           "mean_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "norm_latency_ms",
           "p99_norm_latency_ms", "peak_kv_usage_pct", "peak_kv_tokens", "peak_running",
           "peak_waiting", "prefix_cache_hit_pct", "shared_kv_read_pct", "others_cpu_pct", "metric_samples"]
NOTES_BEGIN, NOTES_END = "<!-- notes: kept across runs -->", "<!-- /notes -->"


def write(rows: list[dict], setup: dict, out: Path, tag: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out / f"ab_{tag}.csv", out / f"ab_{tag}.md"
    with open(csv_path, "w", newline="") as f:
        wr = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        wr.writeheader()
        for r in rows:
            wr.writerow({k: _fmt_csv(r.get(k, "")) for k in COLUMNS})
    notes = ""
    if md_path.exists():                      # hand-written analysis survives a re-run
        old = md_path.read_text()
        if NOTES_BEGIN in old and NOTES_END in old:
            notes = old[old.index(NOTES_BEGIN):old.index(NOTES_END) + len(NOTES_END)]
    plots = _plots(rows, setup, out, tag)
    md_path.write_text(_markdown(rows, setup, tag, notes, plots))
    return [csv_path, md_path] + plots


def _fmt_csv(v):
    if isinstance(v, float):
        return "" if math.isnan(v) else ("inf" if math.isinf(v) else f"{v:.4g}")
    return v


def _ok(rows, system=None, group=None):
    return [r for r in rows if r.get("status") == "ok" and (system is None or r["system"] == system)
            and (group is None or r["group"] == group)]


def _index(rows):
    return {(r["system"], r["workload"]): r for r in rows if r.get("status") == "ok"}


def _f(v, d=1):
    if v is None or v == "" or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:,.{d}f}"


def _x(v):
    return "–" if math.isnan(v) else f"{v:.2f}×"


def _ratio(a, b):
    return a / b if a and b and not math.isnan(a) and not math.isnan(b) else math.nan


def _table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def _markdown(rows, setup, tag, notes, plots) -> str:
    idx = _index(rows)
    systems = setup["systems"]
    names = list(dict.fromkeys(r["workload"] for r in rows))
    meta = {r["workload"]: r for r in rows}
    A = "stock" if "stock" in systems else systems[0]          # throughput baseline
    B = "custom" if "custom" in systems else systems[-1]
    parts = [f"# A/B: stock vLLM vs `--attention-backend CUSTOM` ({tag})", "",
             f"- model: `{setup['model']}`; common server flags: `{setup['server_args']}`",
             f"- systems: {', '.join(systems)} (stock = vLLM's own attention with prefix caching "
             "on; stock-nopc = the same with `--no-enable-prefix-caching`; custom = "
             "`--attention-backend CUSTOM`)",
             f"- commit {setup['commit']}, {setup['date']}, {setup['machine']}; "
             + (f"wall {setup.get('wall_min', 0):.1f} min (time limit "
                f"{setup['time_limit_min']:.0f} min); " if setup.get("time_limit_min") else "")
             + f"CUSTOM native kernel: {setup.get('native', '?')}",
             f"- client: {setup.get('client', CPU_CLIENT)}",
             "- normalised latency = mean over requests of (end-to-end latency incl. queueing / "
             "output tokens per sequence), as in the paper; TPOT = (latency - TTFT) / (tokens - "
             "1); peak KV / batch = max of `vllm:kv_cache_usage_perc` / "
             f"`vllm:num_requests_running` sampled every {setup.get('sample_s', 0.2):g} s; "
             "shared KV reads = share of the "
             "decode's KV reads served by chunks shared within a step (CUSTOM's counters)", ""]
    if notes:
        parts += [notes, ""]

    body = []
    for w in names:
        m = meta[w]
        if m["group"] == "sweep":
            continue
        a, b = idx.get((A, w)), idx.get((B, w))
        g = lambda r, k: r.get(k) if r else None
        body.append([w, str(m["shared_len"]), str(m["num_prefixes"]), str(m["n"]),
                     _f(g(a, "output_tok_s"), 0), _f(g(b, "output_tok_s"), 0),
                     _x(_ratio(g(b, "output_tok_s"), g(a, "output_tok_s"))),
                     f"{_f(g(a, 'mean_tpot_ms'))} / {_f(g(a, 'p99_tpot_ms'))}",
                     f"{_f(g(b, 'mean_tpot_ms'))} / {_f(g(b, 'p99_tpot_ms'))}",
                     _f(g(a, "norm_latency_ms")), _f(g(b, "norm_latency_ms")),
                     _f(g(b, "shared_kv_read_pct"), 0)])
    parts += [f"## Throughput and latency ({A} vs {B}; like the paper's Table 4)", "",
              _table(["workload", "shared", "prefixes", "n", f"{A} tok/s", f"{B} tok/s",
                      f"{B}/{A}", f"{A} TPOT mean/p99 ms", f"{B} TPOT mean/p99 ms",
                      f"{A} norm lat ms/tok", f"{B} norm lat ms/tok",
                      f"{B} shared KV reads %"], body), ""]

    body = []
    for w in names:
        m = meta[w]
        if m["group"] == "sweep" and m["request_rate"] != max(
                r["request_rate"] for r in rows
                if r["group"] == "sweep" and r["shared_len"] == m["shared_len"]):
            continue                       # a sweep's highest rate stands for its shared length
        cells = [w]
        for s in systems:
            r = idx.get((s, w))
            cells.append(f"{r['peak_kv_tokens']:,} ({_f(r['peak_kv_usage_pct'])}%)" if r else "–")
        for s in systems:
            r = idx.get((s, w))
            cells.append(str(r["peak_running"]) if r else "–")
        kv = {s: idx[(s, w)]["peak_kv_tokens"] for s in systems if (s, w) in idx}
        for base in ("stock-nopc", "stock"):
            if base in systems and B != base:
                cells.append(_f(100 * (_ratio(kv.get(B), kv.get(base)) - 1), 0) + " %"
                             if kv.get(B) and kv.get(base) else "–")
        body.append(cells)
    head = (["workload"] + [f"{s} peak KV tokens" for s in systems]
            + [f"{s} peak batch" for s in systems]
            + [f"{B} vs {b}" for b in ("stock-nopc", "stock") if b in systems and b != B])
    parts += ["## Peak KV cache and running batch", "", _table(head, body), ""]

    sweep = [r for r in rows if r["group"] == "sweep"]
    if sweep:
        rates = sorted({r["request_rate"] for r in sweep})
        body = []
        for s in [s for s in systems if any(r["system"] == s for r in sweep)]:
            for p in sorted({r["shared_len"] for r in sweep}):
                pts = [r for r in _ok(sweep, s) if r["shared_len"] == p]
                by_rate = {r["request_rate"]: r for r in pts}
                cells = [s, str(p)]
                cells += [f"{_f(by_rate[x]['norm_latency_ms'])} / {_f(by_rate[x]['output_tok_s'], 0)}"
                          if x in by_rate else "–" for x in rates]
                good = [r["output_tok_s"] for r in pts if r["norm_latency_ms"] < setup["slo_ms"]]
                cells.append(_f(max(good), 0) if good else "none")
                body.append(cells)
        parts += ["## Request-rate sweep (Poisson arrivals; like the paper's Fig. 5)", "",
                  "Cells: normalised latency ms/token / output tok/s.", "",
                  _table(["system", "shared"] + [f"{x:g} req/s" for x in rates]
                         + [f"max tok/s at norm lat < {setup['slo_ms']:g} ms"], body), ""]

    busy = [r for r in _ok(rows) if r.get("others_cpu_pct", 0) >= 5]
    if busy:
        worst = max(busy, key=lambda r: r["others_cpu_pct"])
        parts += [f"**Shared machine:** other processes used ≥ 5 % of the CPUs during "
                  f"{len(busy)} of {len(_ok(rows))} runs (worst: {worst['others_cpu_pct']:.0f} % "
                  f"during {worst['system']} {worst['workload']}); see `others_cpu_pct` in the "
                  "CSV.", ""]
    parts += ["## Goals", "", *_goals(idx, systems, names, meta, A, B,
                                       setup.get("goals", CPU_GOALS)), ""]
    if plots:
        parts += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    skipped = [r for r in rows if r.get("status") != "ok"]
    if skipped:
        parts += ["## Runs that did not complete", "",
                  _table(["system", "workload", "status"],
                         [[r["system"], r["workload"], str(r.get("status"))] for r in skipped]), ""]
    if setup.get("workloads"):
        parts += ["## Workloads (`vllm bench serve` flags)", "",
                  _table(["workload", "prompts", "rate", "flags"],
                         [[n, str(k), f"{r:g}", f"`{f}`"] for n, k, r, f in setup["workloads"]]),
                  ""]
    parts += [f"All runs, all columns: `ab_{tag}.csv`.", ""]
    return "\n".join(parts)


CPU_CLIENT = ("vLLM's `vllm bench serve` (`vllm.benchmarks.serve`), `--ignore-eos --temperature 0 "
              "--seed 0`; prefix cache reset before every run")
# speed-up: (shared tokens, least B/A output tok/s) checked on every "shared" workload of that
# length with one prefix (on the GPU: 32 and 128 concurrent); kv_vs_stock: the most B's peak KV
# tokens may exceed stock's (prefix caching on), as a fraction, on every workload both ran (None:
# not a goal).
CPU_GOALS = {"speedup": ((2048, 2.0), (0, 0.95)), "kv_vs_stock": None}


def kv_change_line(idx, names, A: str, B: str, bound: float, key: str = "peak_kv_tokens",
                   what: str = "peak KV tokens", digits: int = 0) -> str | None:
    """The KV goal's line: B's `key` against A's (prefix caching on), the worst over the workloads
    where both have a number (A's nonzero); None where none has. serve_steps judges per-step peaks
    with it."""
    def number(v):
        return isinstance(v, (int, float)) and not math.isnan(v)
    changes = [(idx[(B, w)][key] / idx[(A, w)][key] - 1, w) for w in names
               if (A, w) in idx and (B, w) in idx and number(idx[(A, w)].get(key))
               and idx[(A, w)][key] and number(idx[(B, w)].get(key))]
    if not changes:
        return None
    worst, w = max(changes)
    return (f"- {what} {B} vs {A} (prefix caching on), worst over {len(changes)} workloads: "
            f"**{100 * worst:+.{digits}f} %** ({w}; goal ≤ {100 * bound:+.0f} %): "
            f"{'met' if worst <= bound else 'NOT met'}")


def _goals(idx, systems, names, meta, A, B, goals) -> list[str]:
    lines = []

    def speedups(p):
        for w in names:
            a, b = idx.get((A, w)), idx.get((B, w))
            if (a and b and meta[w]["group"] == "shared" and meta[w]["shared_len"] == p
                    and meta[w]["num_prefixes"] <= 1):
                yield w, b["output_tok_s"] / a["output_tok_s"]

    for p, goal in goals["speedup"]:
        for w, x in speedups(p):
            lines.append(f"- {B}/{A} output tok/s at {p} shared tokens ({w}): **{x:.2f}×** "
                         f"(goal ≥ {goal}×): {'met' if x >= goal else 'NOT met'}")
    if goals.get("kv_vs_stock") is not None and A == "stock":
        line = kv_change_line(idx, names, A, B, goals["kv_vs_stock"])
        lines += [line] if line else []
    if "stock-nopc" in systems:
        red = []
        for w in names:
            a, b = idx.get(("stock-nopc", w)), idx.get((B, w))
            if a and b and a["peak_kv_tokens"] and meta[w]["shared_len"]:
                red.append((b["peak_kv_tokens"] / a["peak_kv_tokens"] - 1, w))
        for change, w in red:
            if w == "shared2048":
                lines.append(f"- peak KV {B} vs stock-nopc at 2048 shared tokens: **{100 * change:+.0f} %**"
                             f" (goal −70 % or better): {'met' if change <= -0.7 else 'NOT met'}")
        if red:
            lo, hi = min(red), max(red)
            lines.append(f"- peak KV {B} vs stock-nopc over the workloads with shared prefixes: "
                         f"{100 * lo[0]:+.0f} % ({lo[1]}) to {100 * hi[0]:+.0f} % ({hi[1]})")
    return lines or ["- (not enough runs to judge)"]


def _plots(rows, setup, out: Path, tag: str) -> list[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("ab: matplotlib not installed (pip install matplotlib): no plots", flush=True)
        return []
    paths = []
    sweep = _ok(rows, group="sweep")
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        styles = {"stock": "--", "stock-nopc": ":", "custom": "-"}
        lens = sorted({r["shared_len"] for r in sweep})
        colors = dict(zip(lens, ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]))
        for s in setup["systems"]:
            for p in lens:
                pts = sorted((r["request_rate"], r["norm_latency_ms"]) for r in sweep
                             if r["system"] == s and r["shared_len"] == p)
                if pts:
                    ax.plot(*zip(*pts), styles.get(s, "-."), marker="o", color=colors[p],
                            label=f"{s}, shared {p}")
        ax.axhline(setup["slo_ms"], color="grey", lw=0.8)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel("normalised latency (ms/token)")
        ax.set_title(f"Normalised latency vs request rate ({tag})")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        paths.append(_save(fig, out / f"ab_{tag}_latency.png"))
    other = [r for r in _ok(rows) if r["group"] != "sweep"]
    if other:
        names = list(dict.fromkeys(r["workload"] for r in other))
        systems = setup["systems"]
        fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names) + 2), 4.5))
        width = 0.8 / len(systems)
        for i, s in enumerate(systems):
            v = {r["workload"]: r["output_tok_s"] for r in other if r["system"] == s}
            ax.bar([j + i * width for j in range(len(names))], [v.get(n, 0) for n in names],
                   width, label=s)
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(names))])
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"Output throughput per workload ({tag})")
        ax.legend(fontsize=8)
        paths.append(_save(fig, out / f"ab_{tag}_throughput.png"))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
