"""What benchmarks/gpu/serve_ab.sh read from a server's /metrics while it served: the samples
taken every 0.25 s (kv.tsv: KV usage, running requests, the processes' load) and the counters and
histograms read before and after each run (counters: their differences over the run).
"""
from __future__ import annotations

import math
import statistics

# serve_sampler.py's load samples: a workload's mean of each while requests ran goes into its row.
LOAD = ("api_server_cpu_pct", "client_cpu_pct", "engine_core_cpu_pct", "gpu_busy_pct")


def sample_lines(kv_tsv: str):
    """(time, workload, metric, value) of serve_ab.sh's kv.tsv lines. A line of another shape is
    a sample cut short where the sampler was stopped: left out."""
    for line in kv_tsv.splitlines():
        fields = line.split()
        if len(fields) == 4:
            yield fields[0], fields[1], fields[2], float(fields[3])


def samples(kv_tsv: str) -> dict[tuple[str, str], list[float]]:
    """(workload, metric) -> its samples."""
    out: dict = {}
    for _, workload, metric, value in sample_lines(kv_tsv):
        out.setdefault((workload, metric), []).append(value)
    return out


def load_while_serving(kv_tsv: str) -> dict[tuple[str, str], float]:
    """(workload, metric) -> the mean of a LOAD metric over the samples taken while requests
    ran (vllm:num_requests_running > 0 at the same time). A run's whole span also holds the
    client's start-up, ~20 s of a 36 s run on the H100 with nothing to serve: averaged over it,
    an API server at 92-102 % of a core while 256 requests decoded read as 29 % (round 2)."""
    at: dict[tuple[str, str], dict[str, float]] = {}
    for when, workload, metric, value in sample_lines(kv_tsv):
        at.setdefault((when, workload), {})[metric] = value
    seen: dict[tuple[str, str], list[float]] = {}
    for (_, workload), values in at.items():
        if values.get("vllm:num_requests_running", 0) > 0:
            for key in LOAD:
                if key in values:
                    seen.setdefault((workload, key), []).append(values[key])
            # GPU idle: no kernel ran in the whole sample while requests counted as running (the
            # H200 pair's CUSTOM waves: seconds of it while one API server streamed a backlog).
            if "gpu_busy_pct" in values:
                seen.setdefault((workload, "gpu_idle_pct"), []).append(
                    100.0 * (values["gpu_busy_pct"] == 0))
    return {k: statistics.mean(v) for k, v in seen.items()}


def peaks(sampled: dict[tuple[str, str], list[float]]) -> dict:
    """(workload, metric) -> the largest of its samples."""
    return {k: max(v) for k, v in sampled.items()}


def counter_deltas(counters: str) -> dict[str, float]:
    """name -> after - before, for the counters serve_ab.sh read on /metrics around a run (only
    those read both times)."""
    seen = {}
    for line in counters.splitlines():
        when, *pairs = line.split()
        seen[when] = {k: float(v) for k, v in (p.split("=") for p in pairs)}
    before, after = seen.get("before", {}), seen.get("after", {})
    return {k: after[k] - before[k] for k in after.keys() & before.keys()}


def shared_kv_read_pct(counters: str) -> float:
    """Share of a workload's decode KV reads served by shared chunks, from the chunkattn:decode_*
    counters; nan without them (stock)."""
    d = counter_deltas(counters)
    reads = d.get("chunkattn:decode_kv_tokens_total", 0)
    shared = d.get("chunkattn:decode_shared_kv_tokens_total")
    return 100 * shared / reads if reads > 0 and shared is not None else math.nan


def histogram_mean_ms(counters: str, metric: str) -> float:
    """The mean of one of vLLM's histograms over a run (its _sum and _count read around it), in
    ms; nan where not read or nothing was observed."""
    d = counter_deltas(counters)
    count = d.get(f"{metric}_count", 0)
    total = d.get(f"{metric}_sum")
    return 1e3 * total / count if count > 0 and total is not None else math.nan


def engine_itl_ms(counters: str) -> float:
    """The run's mean inter-token latency as the engine timed it: vLLM's
    vllm:inter_token_latency_seconds histogram takes each token's time from the engine core's
    output timestamps, so an API server or client that falls behind does not lengthen it (the
    client's TPOT it does); with async scheduling, a decode step. nan where not read."""
    return histogram_mean_ms(counters, "vllm:inter_token_latency_seconds")


# A request's time to its first token, split by the engine core's own timestamps: queued (from
# its arrival at the engine to its first scheduling: the scheduler's wait for room) and prefill
# (from then to its first token). CUSTOM's TTFT was 10-25 % longer than stock's on the H100 pair.
ENGINE_TTFT_PARTS = {"engine_queue_ms": "vllm:request_queue_time_seconds",
                     "engine_prefill_ms": "vllm:request_prefill_time_seconds"}
