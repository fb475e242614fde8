"""A served workload's engine steps, from vLLM's own iteration log.

benchmarks/gpu/serve_ab.sh starts both systems with `--enable-logging-iteration-details`: the
API server then logs one line per executed batch, e.g.

    Engine 000: Iteration(49): 0 context requests, 0 context tokens, 128 generation requests,
    128 generation tokens, iteration elapsed time: 9.37 ms, GPU KV cache usage: 12.4%

and serve_ab.sh's bench() asks `GET /health?serve_ab=<workload>.start` before a workload and
`.end` after it. Both reach the log through the API server process (its access log and its stat
logger), in order, so the iteration lines between a workload's two marks are its steps.

What a step line gives that the 0.25 s /metrics samples cannot:
- the KV usage of every step (to 0.1 % of the cache), so the workload's peak, not a sample of it;
- "elapsed": with async scheduling (vLLM's GPU default), the time the engine core blocked on the
  batch's result (vllm/v1/engine/core.py, step_with_batch_queue): near the step's length when the
  GPU is the bottleneck, near 0 when the host is (the result was ready before it was asked for).
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

from .ab_report import _f, _table, kv_change_line

MARK = re.compile(r'"GET /health\?serve_ab=([\w-]+)\.(start|end) HTTP')
ITERATION = re.compile(
    r"Iteration\(\d+\): (\d+) context requests, (\d+) context tokens, (\d+) generation requests, "
    r"(\d+) generation tokens, iteration elapsed time: ([\d.]+) ms.*? KV cache usage: ([\d.]+)%")


@dataclass(frozen=True)
class Step:
    context_requests: int
    context_tokens: int
    generation_requests: int
    generation_tokens: int
    elapsed_ms: float
    kv_usage_pct: float


def workload_steps(server_log: str) -> dict[str, list[Step]]:
    """workload -> its steps, in order; a workload with a start but no end (the run was cut)
    keeps the steps logged up to the cut."""
    out: dict[str, list[Step]] = {}
    current = None
    for line in server_log.splitlines():
        if (m := MARK.search(line)) is not None:
            name, edge = m.groups()
            current = name if edge == "start" else None
            if current is not None:
                out[current] = []
        elif current is not None and (m := ITERATION.search(line)) is not None:
            *counts, elapsed, kv = m.groups()
            out[current].append(Step(*map(int, counts), float(elapsed), float(kv)))
    return out


def peak_kv_usage_pct(server_log: str) -> float:
    """The highest KV usage (% of the cache) of any step the log has, marks or not; nan if none."""
    return max((float(m.group(6)) for m in ITERATION.finditer(server_log)), default=math.nan)


def step_stats(steps: list[Step], duration_s: float, capacity_tokens: int) -> dict:
    """A workload's step numbers (nan without steps): `steps`; `mean_step_ms` = the benchmark's
    duration / its steps; `decode_wait_ms` = the median wait for the result of a decode-only step
    (no context tokens) at the workload's largest decode batch; `step_peak_kv_tokens` = the
    highest KV usage of any step x the cache's tokens."""
    if not steps:
        return dict(steps=math.nan, mean_step_ms=math.nan, decode_wait_ms=math.nan,
                    step_peak_kv_tokens=math.nan)
    decode = [s for s in steps if s.context_tokens == 0 and s.generation_requests > 0]
    full = max((s.generation_requests for s in decode), default=0)
    waits = [s.elapsed_ms for s in decode if s.generation_requests == full]
    return dict(steps=len(steps),
                mean_step_ms=1e3 * duration_s / len(steps) if duration_s else math.nan,
                decode_wait_ms=statistics.median(waits) if waits else math.nan,
                step_peak_kv_tokens=round(max(s.kv_usage_pct for s in steps) / 100 * capacity_tokens)
                if capacity_tokens else math.nan)


def of_bound(tokens: float, bound: float) -> str:
    """KV tokens beside the workload's bound (serve_ab_report.kv_bound_tokens): "54,882 (99.3 %)";
    the bare count where there is no bound."""
    return f"{tokens:,.0f}" + ("" if math.isnan(bound) else f" ({100 * tokens / bound:.1f} %)")


def steps_section(rows: list[dict], systems: list[str], kv_goal: float) -> str:
    """The report's table of engine steps per workload and system, and the KV goal (`kv_goal`:
    the most custom's peak may exceed stock's, as a fraction) judged on the per-step peaks where
    both systems logged them; "" when no run logged steps."""
    if not any(not math.isnan(r.get("steps", math.nan)) for r in rows):
        return ""
    idx = {(r["system"], r["workload"]): r for r in rows}
    keys = (("steps", "steps", 0), ("mean_step_ms", "mean step ms", 2),
            ("decode_wait_ms", "decode-step wait ms", 2))
    head = ["workload", *(f"{s} {label}" for _, label, _ in keys for s in systems),
            *(f"{s} peak KV per step (% of bound)" for s in systems)]
    names = list(dict.fromkeys(r["workload"] for r in rows))
    body = []
    for w in names:
        got = [idx.get((s, w), {}) for s in systems]
        peaks = [g.get("step_peak_kv_tokens", math.nan) for g in got]
        bound = next((g["kv_bound_tokens"] for g in got if g), math.nan)
        body.append([w, *(_f(g.get(k, math.nan), nd) for k, _, nd in keys for g in got),
                     *("–" if math.isnan(p) else of_bound(p, bound) for p in peaks)])
    text = ["", "## Engine steps (vLLM's iteration log)", "",
            "From the server's `--enable-logging-iteration-details` lines between each workload's "
            "marks (bench/serve_steps.py): steps = batches executed; mean step = the benchmark's "
            "duration / its steps; decode-step wait = the median time the engine core blocked "
            "on a decode-only batch's result at the workload's largest batch (near the step "
            "when the GPU is the bottleneck, near 0 when the host is); peak KV per step = the "
            "highest KV usage any step logged (0.1 % of the cache) x the cache's tokens.", "",
            _table(head, body)]
    goal = kv_change_line(idx, names, "stock", "custom", kv_goal, key="step_peak_kv_tokens",
                          what="peak KV per step", digits=1)
    if goal:
        text += ["", goal]
    return "\n".join(text) + "\n"
