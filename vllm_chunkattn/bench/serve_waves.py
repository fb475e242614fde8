"""TTFT by wave, from the client's own record of a `vllm bench serve` run (`--save-detailed`).

serve_ab.sh runs every workload with `--ignore-eos` and, for the shared-prefix ones, more prompts
than `--max-concurrency`: the first max_concurrency requests start at once (wave 1), and each
later request starts as one ends, all of a wave's requests ending on about the same step (wave 2
starts as wave 1 ends). Requests whose prefill ends in the same engine step get their first
token together, so the first-token times of a wave fall in groups, one per prefill step. Where a
wave's TTFT goes, without the engine's iteration log (which vLLM 0.32 does not write with
--api-server-count > 1):
- first full step: when the wave's first prefill step of full size delivered its first tokens,
  from the wave's first start. Before it: the requests reaching the engine (HTTP, tokenization
  in the API servers) and the first prefills; the H200 pair's iteration log (one API server)
  shows the first request prefilled alone, then decoding alone for 19-69 steps before the next
  requests of its wave reached the engine.
- step: the median time between the wave's full-size prefill steps (8192 tokens each at
  vLLM's default budget): the engine's prefill step, the same kernels (FLASH_ATTN) in both
  systems.
"""
from __future__ import annotations

import math
import statistics

from . import ab_report

# First tokens less than this apart came from one engine step (a step of the 8B shape's prefill
# takes ~200 ms on an H100; the API servers send one step's first tokens within a few ms).
STEP_GAP_S = 0.02
WAVES_SHOWN = 2


def first_token_steps(first_token_s: list[float]) -> list[tuple[float, int]]:
    """(time of the first, requests) of each group of first-token times no more than STEP_GAP_S
    apart (consecutive in time order): the requests of one prefill step."""
    groups: list[list[float]] = []
    for t in sorted(first_token_s):
        if groups and t - groups[-1][-1] <= STEP_GAP_S:
            groups[-1].append(t)
        else:
            groups.append([t])
    return [(g[0], len(g)) for g in groups]


def waves(res: dict) -> list[dict]:
    """Per wave of max_concurrency requests (in start order; failed requests left out): requests,
    mean TTFT, the first full-size prefill step's delivery from the wave's first start, the
    median time between full-size steps (ms), the largest step's requests. Full size = at least
    half the largest step's requests (and 2)."""
    starts, ttfts = res.get("start_times") or [], res.get("ttfts") or []
    errors = res.get("errors") or [""] * len(starts)
    if not starts or len(ttfts) != len(starts):
        return []
    order = sorted(range(len(starts)), key=starts.__getitem__)
    size = res.get("max_concurrency") or len(order)
    out = []
    for w in range(0, len(order), size):
        mine = [i for i in order[w:w + size] if not errors[i] and ttfts[i] > 0]
        if not mine:
            continue
        t0 = min(starts[i] for i in order[w:w + size])
        steps = first_token_steps([starts[i] + ttfts[i] for i in mine])
        largest = max(n for _, n in steps)
        full = [t for t, n in steps if n >= max(2, largest / 2)]
        gaps = [b - a for a, b in zip(full, full[1:])]
        out.append(dict(requests=len(mine),
                        mean_ttft_ms=1e3 * statistics.fmean(ttfts[i] for i in mine),
                        first_full_step_ms=1e3 * (full[0] - t0) if full else math.nan,
                        step_ms=1e3 * statistics.median(gaps) if gaps else math.nan,
                        largest_step=largest))
    return out


def section(rounds: list[dict], systems: list[str]) -> str:
    """A row per run (system, round, workload) with more than one wave: its first waves."""
    runs = [r for s in systems for r in rounds if r["system"] == s and len(r.get("waves", ())) > 1]
    if not runs:
        return ""
    head = ["workload", "system", "round"]
    for k in range(1, WAVES_SHOWN + 1):
        head += [f"wave {k} mean TTFT ms", f"wave {k} first full step ms", f"wave {k} step ms",
                 f"wave {k} largest step"]
    body = []
    for r in sorted(runs, key=lambda r: (r["workload"], systems.index(r["system"]), r["round"])):
        line = [r["workload"], r["system"], str(r["round"])]
        for wave in r["waves"][:WAVES_SHOWN]:
            line += [ab_report._f(wave["mean_ttft_ms"], 0), ab_report._f(wave["first_full_step_ms"], 0),
                     ab_report._f(wave["step_ms"], 0), str(wave["largest_step"])]
        line += ["–"] * (len(head) - len(line))
        body.append(line)
    return "\n".join(["", "## TTFT by wave (the client's record)", "",
                      f"A wave = max-concurrency requests in start order. First tokens less than "
                      f"{1e3 * STEP_GAP_S:.0f} ms apart = one engine step's prefills; full step = "
                      "one with at least half the largest step's requests. First full step = "
                      "when the wave's first full step delivered, from the wave's first start "
                      "(before it: requests reaching the engine through the API servers, and the "
                      "first prefills); step = the median time between its full steps (the "
                      "engine's prefill step). See vllm_chunkattn/bench/serve_waves.py.", "",
                      ab_report._table(head, body)]) + "\n"
