"""bench/serve_steps.py: a workload's engine steps from vLLM's iteration log lines between
serve_ab.sh's marks. The log lines are shaped as vLLM 0.32 writes them (checked against a real
CPU server started with --enable-logging-iteration-details); every expected number is worked
out by hand."""
from __future__ import annotations

import math

import pytest

from vllm_chunkattn.bench import serve_steps


def _mark(name: str, edge: str) -> str:
    return f'INFO:     127.0.0.1:47518 - "GET /health?serve_ab={name}.{edge} HTTP/1.1" 200 OK'


def _step(ctx_reqs: int, ctx_tokens: int, gen: int, elapsed: float, kv: float, dummy: str = "") -> str:
    return (f"(APIServer pid=1583) INFO 11-26 15:36:22 [loggers.py:199] Engine 000: Iteration(7): "
            f"{ctx_reqs} context requests, {ctx_tokens} context tokens, {gen} generation requests, "
            f"{gen} generation tokens, iteration elapsed time: {elapsed:.2f} ms{dummy}, GPU KV cache "
            f"usage: {kv:.1f}%")


LOG = "\n".join([
    _step(1, 16, 0, 30.0, 0.1),                          # the server's own warm-up: no workload
    _mark("prefix1x2k_c128", "start"),
    'INFO:     127.0.0.1:58166 - "GET /metrics HTTP/1.1" 200 OK',
    _step(2, 4416, 0, 50.0, 1.0),                        # prefill
    _step(1, 160, 1, 20.0, 1.5),                         # prefill beside a decode row
    _step(0, 0, 2, 9.0, 2.0),
    _step(0, 0, 2, 11.0, 2.5),
    _step(0, 0, 2, 13.0, 2.4, " (dummy)"),
    _step(0, 0, 1, 1.0, 1.2),                            # the last row alone: not the full batch
    _mark("prefix1x2k_c128", "end"),
    _step(0, 0, 1, 5.0, 9.9),                            # between workloads: nobody's
    _mark("random", "start"),
    _step(1, 2208, 0, 40.0, 3.0),
    _step(0, 0, 1, 8.0, 3.1),                            # the run was cut here: no end mark
])


def test_steps_are_the_lines_between_a_workloads_marks():
    got = serve_steps.workload_steps(LOG)
    assert list(got) == ["prefix1x2k_c128", "random"]
    assert len(got["prefix1x2k_c128"]) == 6 and len(got["random"]) == 2
    assert got["prefix1x2k_c128"][0] == serve_steps.Step(2, 4416, 0, 0, 50.0, 1.0)
    assert got["prefix1x2k_c128"][4].kv_usage_pct == 2.4          # the "(dummy)" line parsed
    assert max(s.kv_usage_pct for s in got["prefix1x2k_c128"]) == 2.5   # not 9.9 nor 0.1


def test_peak_kv_usage_over_every_step_line_marks_or_not():
    assert serve_steps.peak_kv_usage_pct(LOG) == 9.9                # the line between workloads
    assert math.isnan(serve_steps.peak_kv_usage_pct(_mark("random", "start")))


def test_step_stats_worked_by_hand():
    steps = serve_steps.workload_steps(LOG)["prefix1x2k_c128"]
    got = serve_steps.step_stats(steps, duration_s=3.0, capacity_tokens=400_000)
    # 6 steps in 3 s; decode-only steps at the largest batch (2 rows): waits 9, 11, 13 -> 11;
    # peak 2.5 % of 400,000 tokens
    assert got == dict(steps=6, mean_step_ms=500.0, decode_wait_ms=11.0, step_peak_kv_tokens=10_000)


def test_no_steps_logged_is_nan_not_zero():
    got = serve_steps.step_stats([], duration_s=3.0, capacity_tokens=400_000)
    assert all(math.isnan(v) for v in got.values())
    only_prefill = serve_steps.workload_steps(LOG)["random"][:1]
    got = serve_steps.step_stats(only_prefill, duration_s=1.0, capacity_tokens=0)
    assert got["steps"] == 1 and math.isnan(got["decode_wait_ms"])
    assert math.isnan(got["step_peak_kv_tokens"])                # no capacity in the log


def test_section_judges_kv_on_step_peaks_only_where_both_logged():
    nan = math.nan
    row = dict(steps=6, mean_step_ms=500.0, decode_wait_ms=11.0, kv_bound_tokens=10_000.0)
    rows = [dict(row, system="stock", workload="a", step_peak_kv_tokens=10_000),
            dict(row, system="custom", workload="a", step_peak_kv_tokens=9_500, decode_wait_ms=1.5),
            dict(row, system="stock", workload="b", step_peak_kv_tokens=8_000),
            dict(row, system="custom", workload="b", step_peak_kv_tokens=nan, steps=nan)]
    md = serve_steps.steps_section(rows, ["stock", "custom"], 0.0)
    assert "| a | 6 | 6 | 500.00 | 500.00 | 11.00 | 1.50 | 10,000 (100.0 %) | 9,500 (95.0 %) |" in md
    assert "| b | 6 | – |" in md
    assert ("- peak KV per step custom vs stock (prefix caching on), worst over 1 workloads: "
            "**-5.0 %** (a; goal ≤ +0 %): met") in md
    rows[1]["step_peak_kv_tokens"] = 10_300
    assert "**+3.0 %** (a; goal ≤ +0 %): NOT met" in serve_steps.steps_section(rows, ["stock", "custom"], 0.0)
    assert serve_steps.steps_section([dict(r, steps=nan) for r in rows], ["stock", "custom"], 0.0) == ""
