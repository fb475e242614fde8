"""TTFT by wave (bench/serve_waves.py) and the report's TTFT outside the engine, from records
made by hand: every expected number is worked out below from the inputs."""
from __future__ import annotations

import json
import math

import pytest

from vllm_chunkattn.bench import serve_ab_report, serve_waves

# 11 requests, 5 concurrent. Wave 1 starts together; its first tokens: one at 0.1 s (the first
# prompt, prefilled alone), then steps of 2 at 0.5 s and 0.7 s. Wave 2 starts as wave 1 ends,
# one request failed (no TTFT); its first tokens: 3 at 2.5 s, 1 at 2.8 s. Wave 3: one request.
RECORD = {
    "max_concurrency": 5,
    "start_times": [0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 2.05, 2.1, 2.2, 2.4, 4.0],
    "ttfts": [0.1, 0.5, 0.505, 0.7, 0.71, 0.5, 0.0, 0.4, 0.3, 0.4, 0.3],
    "errors": ["", "", "", "", "", "", "timeout", "", "", "", ""],
}


def test_first_tokens_group_by_engine_step():
    steps = serve_waves.first_token_steps([0.7, 0.1, 0.5, 0.71, 0.505, 0.52, 0.55])
    # 0.5, 0.505, 0.52 chain within 20 ms; 0.55 is 30 ms after 0.52: a step of its own
    assert steps == [(0.1, 1), (0.5, 3), (0.55, 1), (0.7, 2)]


def test_waves_in_start_order_with_their_full_steps():
    w1, w2, w3 = serve_waves.waves(RECORD)
    assert w1["requests"] == 5 and w1["largest_step"] == 2
    assert w1["mean_ttft_ms"] == pytest.approx(1e3 * (0.1 + 0.5 + 0.505 + 0.7 + 0.71) / 5)
    assert w1["first_full_step_ms"] == pytest.approx(500.0)     # the 0.1 s single is not full
    assert w1["step_ms"] == pytest.approx(200.0)
    # wave 2: the failed request left out, its start kept (first start 2.0 s); steps of 3 and
    # 1 at 2.5 and 2.8 s: the single is under half the largest (1.5), so one full step
    assert w2["requests"] == 4 and w2["largest_step"] == 3
    assert w2["mean_ttft_ms"] == pytest.approx(1e3 * (0.5 + 0.4 + 0.3 + 0.4) / 4)
    assert w2["first_full_step_ms"] == pytest.approx(500.0)
    assert math.isnan(w2["step_ms"])
    # wave 3: one request (4.0 s + 0.3 s), no step of 2 or more
    assert w3["requests"] == 1 and math.isnan(w3["first_full_step_ms"])


def test_a_record_without_per_request_times_has_no_waves():
    assert serve_waves.waves({"max_concurrency": 4}) == []
    assert serve_waves.waves({"start_times": [0.0, 1.0], "ttfts": [0.1]}) == []


def test_the_section_shows_each_runs_first_two_waves():
    rounds = [dict(system=s, round=r, workload="prefix1x2k_c256", waves=serve_waves.waves(RECORD))
              for s, r in (("custom", 6), ("stock", 5))]
    rounds.append(dict(system="stock", round=6, workload="random", waves=[]))    # one wave: left out
    md = serve_waves.section(rounds, ["stock", "custom"])
    lines = [line for line in md.splitlines() if line.startswith("| prefix1x2k_c256")]
    assert lines == ["| prefix1x2k_c256 | stock | 5 | 503 | 500 | 200 | 2 | 400 | 500 | – | 3 |",
                     "| prefix1x2k_c256 | custom | 6 | 503 | 500 | 200 | 2 | 400 | 500 | – | 3 |"]
    assert "random" not in md
    assert serve_waves.section(rounds[2:], ["stock"]) == ""


def test_ttft_outside_the_engine_is_the_client_ttft_less_queue_and_prefill(tmp_path):
    """2 requests, TTFT 0.5 s each; the engine's histograms over the run: 4 requests queued 0.2 s
    in all (50 ms each) and prefilled 1.2 s in all (300 ms each) -> 500 - 50 - 300 = 150 ms."""
    res = {"num_prompts": 2, "completed": 2, "failed": 0, "duration": 3.0,
           "output_throughput": 100.0, "latencies": [2.0, 3.0], "ttfts": [0.5, 0.5],
           "output_lens": [256, 256], "start_times": [0.0, 0.0], "max_concurrency": 2,
           "itls": [[0.01] * 255, [0.01] * 255]}
    (tmp_path / "prefix1x2k.json").write_text(json.dumps(res))
    (tmp_path / "prefix1x2k.counters").write_text(
        "before vllm:request_queue_time_seconds_sum=1.0 vllm:request_queue_time_seconds_count=10 "
        "vllm:request_prefill_time_seconds_sum=2.0 vllm:request_prefill_time_seconds_count=10\n"
        "after vllm:request_queue_time_seconds_sum=1.2 vllm:request_queue_time_seconds_count=14 "
        "vllm:request_prefill_time_seconds_sum=3.2 vllm:request_prefill_time_seconds_count=14\n")
    (row,) = serve_ab_report.read_run(tmp_path, "custom", 1, "INFO GPU KV cache size: 1,000 tokens\n")
    assert row["engine_queue_ms"] == pytest.approx(50.0)
    assert row["engine_prefill_ms"] == pytest.approx(300.0)
    assert row["ttft_outside_engine_ms"] == pytest.approx(150.0)
    assert len(row["waves"]) == 1
    (tmp_path / "prefix1x2k.counters").write_text("")       # a run before the histograms were read
    (row,) = serve_ab_report.read_run(tmp_path, "custom", 1, "INFO GPU KV cache size: 1,000 tokens\n")
    assert math.isnan(row["ttft_outside_engine_ms"])
