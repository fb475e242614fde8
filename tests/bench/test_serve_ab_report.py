"""The GPU A/B report (bench/serve_ab_report.py) from files shaped as benchmarks/gpu/serve_ab.sh
leaves them: ABBA rounds combined by their median, per-sequence TPOT for n = 8, peak KV tokens
from /metrics samples x the server's KV capacity, and the GPU goals judged. Every expected
number below is worked out by hand from the inputs."""
from __future__ import annotations

import csv
import gzip
import io
import json
import math
import tarfile
from pathlib import Path

import pytest

from vllm_chunkattn.bench import serve_ab_report, serve_metrics

CAPACITY = 100_000                                    # KV tokens, from the server log
# (system, round) -> workload -> (output tok/s, peak KV usage fraction, failed requests)
RUNS = {
    ("stock", 1): {"random": (1000.0, 0.50, 0), "prefix1x2k": (1000.0, 0.30, 0),
                   "n8x1k": (500.0, 0.20, 0), "prefix1x2k_c128": (1200.0, 0.40, 0),
                   "prefix4x2k": (1000.0, 0.40, 0)},
    ("custom", 1): {"random": (1040.0, 0.55, 0), "prefix1x2k": (1700.0, 0.10, 0),
                    "n8x1k": (900.0, 0.05, 0), "prefix1x2k_c128": (2400.0, 0.10, 0),
                    "prefix4x2k": (1100.0, 0.20, 0)},
    ("custom", 2): {"random": (1020.0, 0.55, 0), "prefix1x2k": (1500.0, 0.10, 3),
                    "n8x1k": (900.0, 0.05, 0)},
    ("stock", 2): {"random": (1100.0, 0.50, 0), "prefix1x2k": (1000.0, 0.30, 0),
                   "n8x1k": (500.0, 0.20, 0)},
}


def _add(t: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size = len(data)
    t.addfile(info, io.BytesIO(data))


def _run_files(root: Path, system: str, rnd: int) -> Path:
    """One serve_ab.sh run's files: results_<tag>.tar.gz (bench JSONs, kv.tsv, ...) and the log."""
    files = root / f"run_{system}_{rnd}"
    files.mkdir()
    tag = f"{system}-r{rnd}"
    kv = []
    with tarfile.open(files / f"results_{tag}.tar.gz", "w:gz") as t:
        for i, (name, (tok_s, usage, failed)) in enumerate(RUNS[(system, rnd)].items()):
            n = 8 if name == "n8x1k" else 1
            # two requests: 2.0 s and 3.0 s end to end, first token after 0.5 s, 256 tokens each
            # per sequence (n sequences' tokens in one request's usage)
            res = {"num_prompts": 2, "completed": 2 - min(failed, 2), "failed": failed,
                   "duration": 3.0, "output_throughput": tok_s,
                   "latencies": [2.0, 3.0], "ttfts": [0.5, 0.5], "output_lens": [256 * n] * 2,
                   "start_times": [0.0, 0.0],
                   # stream messages: 1 + gaps; custom's first request in 7 bursts of ~37 tokens
                   "itls": [[0.3] * (6 if system == "custom" and i == 1 else 255 * n),
                            [0.01] * (255 * n)]}
            _add(t, f"./{name}.json", json.dumps(res))
            _add(t, f"./{name}.flags", f"--dataset-name {name}")
            # serve_ab.sh's /metrics counters around the workload: CUSTOM's decode KV reads,
            # 1000 in this workload, 100 x i of them from shared chunks; stock has none
            reads, shared = ("chunkattn:decode_kv_tokens_total",
                             "chunkattn:decode_shared_kv_tokens_total")
            # and vLLM's inter-token latency histogram: 100 tokens in 0.5 s (custom), 0.9 s (stock)
            itl_sum, itl_n = "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count"
            itl = 0.5 if system == "custom" else 0.9
            _add(t, f"./{name}.counters",
                 f"before {reads}={10_000 * i} {shared}={1000 * i} {itl_sum}={3.25 * i} {itl_n}={500 * i}\n"
                 f"after {reads}={10_000 * i + 1000} {shared}={1100 * i} {itl_sum}={3.25 * i + 0.5} "
                 f"{itl_n}={500 * i + 100}\n" if system == "custom"
                 else f"before {itl_sum}={2.0 * i} {itl_n}={40 * i}\n"
                      f"after {itl_sum}={2.0 * i + itl} {itl_n}={40 * i + 100}\n")
            # serve_sampler.py's samples, all of a time together; at i.0 the client is still
            # starting (no request running): its load is left out of the means
            kv += [f"{i}.0 {name} vllm:num_requests_running 0",
                   f"{i}.0 {name} api_server_cpu_pct 5",
                   f"{i}.0 {name} vllm:kv_cache_usage_perc {usage / 2}",
                   f"{i}.1 {name} vllm:num_requests_running 32",
                   f"{i}.1 {name} api_server_cpu_pct {40 + 10 * i}",
                   f"{i}.2 {name} vllm:num_requests_running 32",
                   f"{i}.2 {name} api_server_cpu_pct {60 + 10 * i}",
                   f"{i}.5 {name} vllm:kv_cache_usage_perc {usage}",
                   f"{i}.5 {name} vllm:num_requests_running 32"]
            if rnd == 1:      # serve_sampler.py's engine core CPU and GPU busy: round 1 only
                gpu = (98, 100) if system == "stock" else (70, 80)
                kv += [f"{i}.0 {name} engine_core_cpu_pct 3", f"{i}.0 {name} gpu_busy_pct 0",
                       f"{i}.1 {name} engine_core_cpu_pct 90", f"{i}.2 {name} engine_core_cpu_pct 100",
                       f"{i}.1 {name} gpu_busy_pct {gpu[0]}", f"{i}.2 {name} gpu_busy_pct {gpu[1]}"]
        _add(t, "./kv.tsv", "\n".join(kv) + "\n")
        _add(t, "./gpu.txt", "NVIDIA H100 80GB HBM3, 580.159.04\n")
        _add(t, "./server_cmd.txt", f"vllm serve /tmp/models/llama-3-8b --port 4242 --dtype bfloat16 ({tag})")
    kernel = "TPP decode kernel=native-cuda, chunk size=16 tokens\n" if system == "custom" else ""
    (files / f"server_{tag}.log").write_text(
        f"INFO GPU KV cache size: {CAPACITY:,} tokens\n{kernel}"
        "Capturing CUDA graphs (decode, FULL): 100%\n" + (_step_lines(system, rnd) if rnd == 1 else ""))
    return files


def _step_lines(system: str, rnd: int) -> str:
    """vLLM's iteration log (--enable-logging-iteration-details) between serve_ab.sh's marks: a
    prefill step, two decode steps of 2 rows (waits 10, 12 ms stock; 2, 4 ms custom), one of 1
    row; the peak is the first decode step, 1 point over the sampled peak."""
    lines = []
    for name, (_, usage, _) in RUNS[(system, rnd)].items():
        wait = 10.0 if system == "stock" else 2.0
        lines += [f'INFO:     127.0.0.1:1 - "GET /health?serve_ab={name}.start HTTP/1.1" 200 OK']
        for ctx, gen, elapsed, kv in ((1, 0, 50.0, 50 * usage), (0, 2, wait, 100 * usage + 1),
                                      (0, 2, wait + 2, 100 * usage), (0, 1, 1.0, 100 * usage - 1)):
            lines.append(f"(APIServer pid=1) INFO 11-26 15:36:22 [loggers.py:199] Engine 000: "
                         f"Iteration(3): {ctx} context requests, {2208 * ctx} context tokens, {gen} "
                         f"generation requests, {gen} generation tokens, iteration elapsed time: "
                         f"{elapsed:.2f} ms, GPU KV cache usage: {kv:.1f}%")
        lines += [f'INFO:     127.0.0.1:1 - "GET /health?serve_ab={name}.end HTTP/1.1" 200 OK']
    return "\n".join(lines) + "\n"


@pytest.fixture
def report(tmp_path):
    runs = [_run_files(tmp_path, s, r) for s, r in RUNS]
    out = tmp_path / "out"
    assert serve_ab_report.main([*map(str, runs), "--tag", "gpu_test", "--out", str(out)]) == 0
    with open(out / "ab_gpu_test_rounds.csv") as f:
        rounds = list(csv.DictReader(f))
    with open(out / "ab_gpu_test.csv") as f:
        combined = {(r["system"], r["workload"]): r for r in csv.DictReader(f)}
    return rounds, combined, (out / "ab_gpu_test.md").read_text()


def test_rounds_are_combined_by_median_and_a_lossy_round_is_left_out(report):
    rounds, combined, _ = report
    assert len(rounds) == 16
    lossy = [r for r in rounds if r["status"] != "ok"]
    assert [(r["system"], r["round"], r["workload"], r["status"]) for r in lossy] == [
        ("custom", "2", "prefix1x2k", "3 requests failed")]
    assert float(combined[("stock", "random")]["output_tok_s"]) == 1050      # (1000 + 1100) / 2
    assert float(combined[("custom", "random")]["output_tok_s"]) == 1030     # (1040 + 1020) / 2
    assert float(combined[("custom", "prefix1x2k")]["output_tok_s"]) == 1700  # round 2 lost 3


def test_tpot_is_per_sequence_and_kv_peaks_scale_by_capacity(report):
    rounds, combined, _ = report
    n8 = next(r for r in rounds if r["workload"] == "n8x1k" and r["system"] == "stock")
    # per sequence: 256 tokens; TPOT = (latency - TTFT) / 255, mean of 1.5 s and 2.5 s
    assert float(n8["mean_tpot_ms"]) == pytest.approx(1e3 * (1.5 + 2.5) / 2 / 255)
    assert int(combined[("stock", "prefix1x2k")]["peak_kv_tokens"]) == 30_000  # 0.30 x 100k
    assert int(combined[("custom", "prefix1x2k")]["peak_kv_tokens"]) == 10_000
    assert int(combined[("custom", "random")]["peak_running"]) == 32


def test_kv_peaks_leave_out_samples_cut_short():
    # serve_ab.sh's sampler is killed at the end of a run (its last line may stop mid-write);
    # a 3-field line must not crash the per-run summary, which would lose the run's table.
    tsv = ("1.00 random vllm:kv_cache_usage_perc 0.25\n"
           "1.25 vllm:kv_cache_usage_perc 0.90\n"
           "1.50 random vllm:kv_cache_usage_perc 0.40\n"
           "1.75 random vllm:num_requests_running 7\n"
           "2.00 random vllm:kv_cache")
    assert serve_metrics.peaks(serve_metrics.samples(tsv)) == {("random", "vllm:kv_cache_usage_perc"): 0.40,
                                          ("random", "vllm:num_requests_running"): 7.0}


def test_goals_and_setup_in_the_markdown(report):
    _, _, md = report
    # 1700 / 1000 = 1.70 >= 1.6; 128 concurrent: 2400 / 1200 = 2.00; 1030 / 1050 = 0.981 >= 0.98;
    # KV worst: random 55k vs 50k = +10 %. prefix4x2k (4 prefixes of 2048) is not the goal's.
    assert "at 2048 shared tokens (prefix1x2k): **1.70×** (goal ≥ 1.6×): met" in md
    assert "at 2048 shared tokens (prefix1x2k_c128): **2.00×** (goal ≥ 1.6×): met" in md
    assert "(prefix4x2k): " not in md
    assert "at 0 shared tokens (random): **0.98×** (goal ≥ 0.98×): met" in md
    assert "worst over 5 workloads: **+10 %** (random; goal ≤ +0 %): NOT met" in md
    assert "NVIDIA H100 80GB HBM3" in md and "CUSTOM native kernel: native-cuda" in md
    assert "decode, FULL" in md and "stock 2, custom 2" in md
    assert "vllm serve /tmp/models/llama-3-8b --dtype bfloat16 (stock-r1)" in md
    assert "sampled every 0.25 s" in md and "time limit" not in md
    assert "- model: `/tmp/models/llama-3-8b`" in md


def test_no_results_is_a_clear_error(tmp_path, capsys):
    assert serve_ab_report.main([str(tmp_path), "--tag", "x", "--out", str(tmp_path)]) == 2
    assert "no results_<system>-r<round>.tar.gz" in capsys.readouterr().out


def test_the_device_summary_has_the_reports_rows(tmp_path):
    """serve_ab.sh prints one run's table on the device through the same rows as the report."""
    files = _run_files(tmp_path, "stock", 1)
    run = tmp_path / "run"
    with tarfile.open(files / "results_stock-r1.tar.gz") as t:
        t.extractall(run, filter="data")
    md = serve_ab_report.summary(run, files / "server_stock-r1.log", "stock-r1")
    lines = md.splitlines()
    assert lines[0].startswith("# stock-r1:") and len(lines) == 4 + 5
    # random: 1000 tok/s, peak KV 0.50; n8x1k TPOT per sequence: (1.5 + 2.5) / 2 / 255 s
    assert "| random | 2 | 1000.0 | 7.84 |" in md and "| 50.0 | 32 |" in md
    assert f"| n8x1k | 2 | 500.0 | {1e3 * 2.0 / 255:.2f} |" in md
    # API server, engine core CPU and GPU busy: the means of the fixture's samples
    # + the step log; no client CPU sampled
    assert "| 50 | nan | 95 | 99 | 750.00 | 11.00 | 51,000 |" in md.splitlines()[4]


def test_share_of_decode_kv_reads_from_shared_chunks_per_workload(report):
    """Worked from the fixture's counters: (1100 i - 1000 i) / 1000 = 10 i % for the i-th workload;
    stock's /metrics has no chunkattn counters: no share."""
    rounds, combined, md = report
    for i, w in enumerate(("random", "prefix1x2k", "n8x1k", "prefix1x2k_c128", "prefix4x2k")):
        assert float(combined[("custom", w)]["shared_kv_read_pct"]) == pytest.approx(10 * i)
        assert combined[("stock", w)]["shared_kv_read_pct"] == ""           # nan, left blank
    assert "| 1,700 | 1.70× |" in md and md.count("| 30 |") == 1      # prefix1x2k_c128's row
    assert serve_metrics.shared_kv_read_pct("before \nafter \n") != serve_metrics.shared_kv_read_pct("before \nafter \n")   # nan
    cut = "before chunkattn:decode_kv_tokens_total=5 chunkattn:decode_shared_kv_tokens_total=1\n"
    assert serve_metrics.shared_kv_read_pct(cut) != serve_metrics.shared_kv_read_pct(cut)  # no after


def test_committed_runs_with_gzipped_server_logs_give_the_same_report(tmp_path, report):
    """Results are committed with their server logs gzipped (benchmarks/results/gpu_h100_serve)."""
    root = tmp_path / "committed"
    root.mkdir()
    runs = [_run_files(root, s, r) for s, r in RUNS]
    for log in root.glob("run_*/server_*.log"):
        log.with_name(log.name + ".gz").write_bytes(gzip.compress(log.read_bytes()))
        log.unlink()
    out = tmp_path / "gz"
    assert serve_ab_report.main([*map(str, runs), "--tag", "gpu_test", "--out", str(out)]) == 0
    assert (out / "ab_gpu_test.md").read_text() == report[2]


def test_a_pairs_rounds_read_their_systems_one_log(tmp_path, report):
    """serve_ab.sh pair writes one server_<system>.log for both rounds of a system (gzipped when
    committed); each round reads it as it would its own: the same report."""
    root = tmp_path / "pair"
    root.mkdir()
    runs = [_run_files(root, s, r) for s, r in RUNS]
    for log in root.glob("run_*/server_*-r*.log"):
        system = log.name.split("_")[1].split("-")[0]
        log.with_name(f"server_{system}.log.gz").write_bytes(gzip.compress(log.read_bytes()))
        log.unlink()
    out = tmp_path / "out"
    assert serve_ab_report.main([*map(str, runs), "--tag", "gpu_test", "--out", str(out)]) == 0
    assert (out / "ab_gpu_test.md").read_text() == report[2]


def test_streaming_section_tokens_per_message_and_api_server_cpu(report):
    """prefix1x2k (i = 1): custom's requests got 7 + 256 messages for 512 tokens, stock's 512;
    the API server's CPU is the mean of its samples while requests ran, 50 and 70 -> 60 (the
    5 % before the first request is left out)."""
    rounds, _, md = report
    got = {(r["system"], r["round"], r["workload"]): r for r in rounds}     # the rounds' CSV
    assert float(got[("stock", "1", "prefix1x2k")]["tokens_per_message"]) == pytest.approx(1.0)
    assert float(got[("custom", "1", "prefix1x2k")]["tokens_per_message"]) == pytest.approx(512 / 263)
    assert float(got[("custom", "1", "prefix1x2k")]["api_server_cpu_pct"]) == pytest.approx(60)
    assert float(got[("stock", "2", "random")]["api_server_cpu_pct"]) == pytest.approx(50)
    assert "## Streaming and load: tokens per stream message, CPU, GPU busy" in md
    # longest silence: stock's first request streams every 0.3 s on after the second one's last
    # message (3.05 s); custom's first request's 7 messages all fall inside the second's 0.01 s
    assert float(got[("stock", "1", "prefix1x2k")]["longest_silence_s"]) == pytest.approx(0.3)
    assert float(got[("custom", "1", "prefix1x2k")]["longest_silence_s"]) == pytest.approx(0.01)
    # engine core (90, 100) and GPU busy (stock 98, 100; custom 70, 80): round 1's means, the
    # only round that sampled them (custom's round 2 lost requests anyway)
    assert ("| prefix1x2k | 9.0 | 5.0 | 1.0 | 1.9 | 0.30 | 0.01 | 60.0 | 60.0 | 95.0 | 95.0 | 99.0 "
            "| 75.0 | 0.0 | 0.0 | 1.80 |\n") in md   # engine ITL first; the engines' ratio last, 9 / 5
    assert "| stock GPU busy % | custom GPU busy % |" in md
    assert serve_ab_report.tokens_per_message({"output_lens": [4]}) != 0   # nan: no itls saved


def test_load_samples_average_per_round_and_combine_over_the_rounds_that_have_them(report):
    rounds, combined, _ = report
    got = {(r["system"], r["round"], r["workload"]): r for r in rounds}
    assert float(got[("custom", "1", "random")]["gpu_busy_pct"]) == pytest.approx(75)
    assert float(got[("stock", "1", "n8x1k")]["engine_core_cpu_pct"]) == pytest.approx(95)
    assert math.isnan(float(got[("custom", "2", "random")]["gpu_busy_pct"]))   # not sampled
    # stock random: round 1 sampled 99, round 2 nothing: the median is round 1's, not nan
    nums = [{k: float(v) if k in serve_ab_report.NUMERIC else v for k, v in r.items()}
            for r in rounds if (r["system"], r["workload"]) == ("stock", "random")]
    (row,) = serve_ab_report.combine(nums)
    assert row["gpu_busy_pct"] == pytest.approx(99) and row["rounds"] == 2
    assert row["output_tok_s"] == 1050                                           # both rounds


def test_gpu_idle_samples_are_the_share_at_zero_busy_while_requests_ran():
    # The H200 pair's CUSTOM waves: the GPU at 0 % for seconds while requests still ran (a
    # backlog streaming out); samples before the first request are not counted.
    kv = "\n".join(["1.0 w vllm:num_requests_running 0", "1.0 w gpu_busy_pct 0",
                    "2.0 w vllm:num_requests_running 256", "2.0 w gpu_busy_pct 0",
                    "3.0 w vllm:num_requests_running 256", "3.0 w gpu_busy_pct 100",
                    "4.0 w vllm:num_requests_running 256", "4.0 w gpu_busy_pct 3",
                    "5.0 w vllm:num_requests_running 1", "5.0 w gpu_busy_pct 0",
                    "6.0 w vllm:num_requests_running 256"]) + "\n"   # no GPU sample: not counted
    load = serve_metrics.load_while_serving(kv)
    assert load[("w", "gpu_idle_pct")] == 50.0
    assert load[("w", "gpu_busy_pct")] == pytest.approx(103 / 4)
    rows = [dict(system="custom", workload="w", tokens_per_message=8.0, longest_silence_s=0.3,
                 gpu_busy_pct=load[("w", "gpu_busy_pct")], gpu_idle_pct=load[("w", "gpu_idle_pct")])]
    assert "| w | 8.0 | 0.30 | 25.8 | 50.0 |" in serve_ab_report.streaming_section(rows, ["custom"])


def test_streaming_columns_no_round_sampled_are_left_out():
    nan = math.nan
    rows = [dict(system="stock", workload="random", tokens_per_message=1.0, longest_silence_s=0.25,
                 api_server_cpu_pct=30.0, engine_core_cpu_pct=nan, gpu_busy_pct=nan)]
    md = serve_ab_report.streaming_section(rows, ["stock"])
    assert "| workload | stock tokens / message | stock longest silence s | stock API server CPU % |" in md
    assert "| random | 1.0 | 0.25 | 30.0 |" in md and "GPU busy %" not in md.split("\n\n")[2]


def test_engine_steps_section_from_the_iteration_log(report):
    """Round 1 logged steps (round 2 did not): 4 steps in the 3 s benchmark -> 750 ms a step;
    decode waits (10, 12) -> 11 stock, (2, 4) -> 3 custom; per-step peaks 1 point over the
    sampled ones: random 51,000 vs 56,000 = +9.8 %, the worst."""
    rounds, _, md = report
    got = {(r["system"], r["round"], r["workload"]): r for r in rounds}
    assert float(got[("stock", "1", "random")]["decode_wait_ms"]) == pytest.approx(11)
    assert float(got[("custom", "1", "prefix1x2k")]["step_peak_kv_tokens"]) == 11_000
    assert math.isnan(float(got[("stock", "2", "random")]["steps"]))
    assert "## Engine steps (vLLM's iteration log)" in md
    assert "| random | 4 | 4 | 750.00 | 750.00 | 11.00 | 3.00 | 51,000 | 56,000 |" in md
    assert ("- peak KV per step custom vs stock (prefix caching on), worst over 5 workloads: "
            "**+9.8 %** (random; goal ≤ +0 %): NOT met") in md


def test_longest_silence_is_over_every_stream_from_each_requests_start():
    # A starts at 0: messages at 0.5, 0.6, 0.7, 2.7; B starts at 1.0: 1.2, 1.3. No stream got a
    # message from 1.3 to 2.7.
    res = {"start_times": [0.0, 1.0], "ttfts": [0.5, 0.2], "itls": [[0.1, 0.1, 2.0], [0.1]]}
    assert serve_ab_report.longest_silence_s(res) == pytest.approx(1.4)
    res["itls"][0][-1] = 0.4                                  # A's last at 1.1: 0.7 .. 1.1
    assert serve_ab_report.longest_silence_s(res) == pytest.approx(0.4)
    assert serve_ab_report.longest_silence_s({"ttfts": [0.5], "itls": [[0.1]]}) != 0  # nan: no starts


def test_kv_bound_is_the_running_rows_at_full_length_the_prefix_once():
    shape = serve_ab_report.WORKLOADS["prefix1x2k_c128"]          # one 2048-token prefix
    # 2 running at most: the two 2208-token requests; each 160 + 255 written private tokens = 26
    # blocks of 16; the prefix's 128 blocks once: 16 x (128 + 26 + 26)
    res = {"input_lens": [2208, 2100, 2208], "output_lens": [256, 256, 256], "max_concurrency": 2}
    assert serve_ab_report.kv_bound_tokens(res, shape) == 16 * (128 + 26 + 26)
    # nothing shared: the longest request alone, 100 + 19 tokens -> 8 blocks
    res = {"input_lens": [100, 30], "output_lens": [20, 5], "max_concurrency": 1}
    assert serve_ab_report.kv_bound_tokens(res, serve_ab_report.WORKLOADS["random"]) == 128
    for w in ("n8x1k", "tree"):                                     # not a row per request
        assert math.isnan(serve_ab_report.kv_bound_tokens(res, serve_ab_report.WORKLOADS[w]))


def test_the_kv_bound_section_sets_each_systems_sample_beside_it():
    rows = [dict(system=s, workload="random", peak_kv_tokens=t, kv_bound_tokens=1000.0)
            for s, t in (("stock", 900), ("custom", 990))]
    md = serve_ab_report.kv_bound_section(rows, ["stock", "custom"])
    assert "| random | 1,000 | 900 (90.0 %) | 990 (99.0 %) |" in md
    rows = [dict(r, kv_bound_tokens=math.nan) for r in rows]           # no bound: no section
    assert serve_ab_report.kv_bound_section(rows, ["stock", "custom"]) == ""


def test_a_pairs_two_rounds_on_one_server_each_read_their_own_runs(tmp_path):
    """`serve_ab.sh pair` runs rounds 3 and 4 of a system on one server: one log and one sampler
    for both, the runs named random-r3 and random-r4 in the marks and samples. Each round's rows
    come from its own run: round 3's steps peak at 20.0 % and its samples at 0.15, round 4's at
    40.0 % and 0.35 (x 100,000 tokens of capacity)."""
    step = ("(APIServer pid=1) INFO 11-27 01:00:00 [loggers.py:199] Engine 000: Iteration(9): 0 "
            "context requests, 0 context tokens, 2 generation requests, 2 generation tokens, "
            "iteration elapsed time: {ms:.2f} ms, GPU KV cache usage: {kv:.1f}%")
    mark = 'INFO:     127.0.0.1:1 - "GET /health?serve_ab=random-r{r}.{edge} HTTP/1.1" 200 OK'
    log = "\n".join([f"INFO GPU KV cache size: {CAPACITY:,} tokens",
                     mark.format(r=3, edge="start"), step.format(ms=5, kv=10), step.format(ms=7, kv=20),
                     mark.format(r=3, edge="end"),
                     mark.format(r=4, edge="start"), step.format(ms=9, kv=40), mark.format(r=4, edge="end")])
    kv = ["1.0 random-r3 vllm:kv_cache_usage_perc 0.15", "1.1 random-r3 gpu_busy_pct 50",
          "1.1 random-r3 vllm:num_requests_running 2",
          "2.0 random-r4 vllm:kv_cache_usage_perc 0.35", "2.1 random-r4 gpu_busy_pct 90",
          "2.1 random-r4 vllm:num_requests_running 2"]
    res = {"num_prompts": 2, "completed": 2, "failed": 0, "duration": 3.0,
           "output_throughput": 100.0, "latencies": [2.0, 3.0], "ttfts": [0.5, 0.5],
           "output_lens": [256, 256], "itls": [[0.01] * 255] * 2, "start_times": [0.0, 0.0]}
    rows = {}
    for rnd in (3, 4):
        run = tmp_path / f"custom-r{rnd}"
        run.mkdir()
        (run / "random.json").write_text(json.dumps(res))
        (run / "kv.tsv").write_text("\n".join(kv) + "\n")      # the server's: both rounds
        [rows[rnd]] = serve_ab_report.read_run(run, "custom", rnd, log)
    assert rows[3]["workload"] == rows[4]["workload"] == "random"
    assert (rows[3]["steps"], rows[4]["steps"]) == (2, 1)
    assert (rows[3]["step_peak_kv_tokens"], rows[4]["step_peak_kv_tokens"]) == (20_000, 40_000)
    assert (rows[3]["peak_kv_tokens"], rows[4]["peak_kv_tokens"]) == (15_000, 35_000)
    assert (rows[3]["gpu_busy_pct"], rows[4]["gpu_busy_pct"]) == (50, 90)
    assert serve_ab_report.run_name("random", 5, {"random-r3", "random-r4"}) == "random"


def test_engine_itl_is_the_histograms_mean_over_the_run(report):
    """vLLM's inter-token latency histogram read around each run: custom 0.5 s over 100 tokens,
    stock 0.9 s: 5 and 9 ms, in the rounds and in the streaming table."""
    rounds, _, md = report
    got = {(r["system"], r["round"], r["workload"]): r for r in rounds}
    assert float(got[("custom", "1", "prefix1x2k")]["engine_itl_ms"]) == pytest.approx(5.0)
    assert float(got[("stock", "2", "random")]["engine_itl_ms"]) == pytest.approx(9.0)
    assert "| stock engine ITL ms | custom engine ITL ms |" in md
    assert md.count("| engine speed-up (stock / custom ITL) |") == 1
    assert math.isnan(serve_metrics.engine_itl_ms("before \nafter \n"))      # not read
    assert math.isnan(serve_metrics.engine_itl_ms(                           # no new token
        "before vllm:inter_token_latency_seconds_sum=1.0 vllm:inter_token_latency_seconds_count=5\n"
        "after vllm:inter_token_latency_seconds_sum=1.0 vllm:inter_token_latency_seconds_count=5\n"))


def test_the_engines_ttft_parts_are_its_queue_and_prefill_histograms_means():
    """vLLM's request queue and prefill time histograms read around a run: 4 requests queued
    0.2 s and prefilled 2.0 s in all -> 50 and 500 ms; columns only where a run read them."""
    counters = ("before vllm:request_queue_time_seconds_sum=1.0 vllm:request_queue_time_seconds_count=10 "
                "vllm:request_prefill_time_seconds_sum=3.0 vllm:request_prefill_time_seconds_count=10\n"
                "after vllm:request_queue_time_seconds_sum=1.2 vllm:request_queue_time_seconds_count=14 "
                "vllm:request_prefill_time_seconds_sum=5.0 vllm:request_prefill_time_seconds_count=14\n")
    got = {k: serve_metrics.histogram_mean_ms(counters, m)
           for k, m in serve_metrics.ENGINE_TTFT_PARTS.items()}
    assert got == pytest.approx({"engine_queue_ms": 50.0, "engine_prefill_ms": 500.0})
    rows = [dict(system="stock", workload="w", engine_itl_ms=9.0, tokens_per_message=1.0, **got),
            dict(system="custom", workload="w", engine_itl_ms=5.0, tokens_per_message=1.0,
                 engine_queue_ms=math.nan, engine_prefill_ms=math.nan)]
    md = serve_ab_report.streaming_section(rows, ["stock", "custom"])
    assert "| stock engine queue ms | custom engine queue ms | stock engine prefill ms |" in md
    assert "| w | 9.0 | 5.0 | 50.0 | – | 500.0 | – |" in md, md
