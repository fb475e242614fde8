"""benchmarks/gpu/serve_sampler.py, serve_ab.sh's sampler, run for real against a /metrics page
served on loopback and a process tree shaped as `vllm serve`'s (an API server with an EngineCore
child): what it writes to kv.tsv is what serve_ab_report reads."""
from __future__ import annotations

import http.server
import importlib.util
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLER = ROOT / "benchmarks" / "gpu" / "serve_sampler.py"
PAGE = ('# HELP vllm:kv_cache_usage_perc KV-cache usage\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.125\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 7.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n')


def _module():
    spec = importlib.util.spec_from_file_location("serve_sampler", SAMPLER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = PAGE.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def metrics_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()


def test_metric_lines_keep_the_kv_metrics_without_labels():
    assert _module().metric_lines(PAGE) == [("vllm:kv_cache_usage_perc", "0.125"),
                                            ("vllm:num_requests_running", "7.0")]


def test_samples_are_tagged_with_the_workload_and_cover_both_processes(tmp_path, metrics_url):
    # An "API server" that busy-loops, with an idle "EngineCore" child, as vLLM titles it.
    api = subprocess.Popen([sys.executable, "-c",
                            "import subprocess, sys, time\n"
                            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', "
                            "'VLLM::EngineCore'])\n"
                            "end = time.time() + 60\n"
                            "while time.time() < end: pass\n"])
    (tmp_path / "current").write_text("")            # no workload yet: nothing is written
    sampler = subprocess.Popen([sys.executable, str(SAMPLER), metrics_url, str(tmp_path), str(api.pid)])
    try:
        time.sleep(1.0)
        assert (tmp_path / "kv.tsv").read_text() == ""
        (tmp_path / "current").write_text("prefix1x2k\n")
        time.sleep(2.0)
    finally:
        sampler.kill()
        sampler.wait()
        import psutil

        for p in [*psutil.Process(api.pid).children(recursive=True), api]:
            p.kill()
        api.wait()
    rows = [line.split() for line in (tmp_path / "kv.tsv").read_text().splitlines()]
    by_metric: dict[str, list[float]] = {}
    for row in rows:
        if len(row) == 4:                          # the last line may be cut by the kill
            assert row[1] == "prefix1x2k"
            by_metric.setdefault(row[2], []).append(float(row[3]))
    assert set(by_metric["vllm:kv_cache_usage_perc"]) == {0.125}
    assert set(by_metric["vllm:num_requests_running"]) == {7.0}
    assert "vllm:num_requests_waiting" not in by_metric
    assert len(by_metric["api_server_cpu_pct"]) >= 4            # 2 s at 0.25 s
    assert reads_busy(by_metric["api_server_cpu_pct"])            # the busy loop
    assert max(by_metric["engine_core_cpu_pct"]) < 20             # found, and idle
    assert "client_cpu_pct" not in by_metric                      # no `vllm bench serve` ran
    # gpu_busy_pct only where NVML answers (a GPU host), never made up elsewhere
    assert ("gpu_busy_pct" in by_metric) == (_module().nvml_busy() is not None)


BUSY = "import time\nend = time.time() + 60\nwhile time.time() < end: pass\n"
IDLE = "import time; time.sleep(60)"


def reads_busy(samples: list[float]) -> bool:
    """A busy loop's CPU % samples (the first only starts psutil's interval), told from an idle
    process's (~0): ~100 on a core of its own, less while other processes share the cores (CI's
    two test workers beside the compile check: 46 once; 35-41 all along for the two busy loops
    of the several-servers test, four busy processes on two cores)."""
    return min(samples[1:]) > 10 and statistics.median(samples[1:]) > 25


def test_with_several_api_servers_the_busiest_is_sampled_and_the_client_too(tmp_path, metrics_url):
    """--api-server-count 2: the `vllm serve` process only watches its VLLM::APIServer_i
    children; the sampled share is the busiest one's (one saturated server is the limit, not the
    sum). The `vllm bench serve` process sending to this server is sampled as client_cpu_pct,
    not the idle `timeout` above it (which reads 0 % all along)."""
    spawn = ("import subprocess, sys, time\n"
             f"for code, title in (({BUSY!r}, 'VLLM::APIServer_0'), ({IDLE!r}, 'VLLM::APIServer_1'),"
             f" ({IDLE!r}, 'VLLM::EngineCore')):\n"
             "    subprocess.Popen([sys.executable, '-c', code, title])\n"
             "time.sleep(60)\n")
    serve = subprocess.Popen([sys.executable, "-c", spawn])
    base = metrics_url.rsplit("/metrics", 1)[0]
    # as serve_ab.sh starts it: under `timeout`, whose own command line names the URL too
    client = subprocess.Popen(["timeout", "60", sys.executable, "-c", BUSY, "bench", "serve",
                               "--base-url", base])
    other = subprocess.Popen([sys.executable, "-c", IDLE, "bench", "serve", "--base-url",
                              "http://127.0.0.1:1"])   # another server's client, idle
    (tmp_path / "current").write_text("prefix1x2k_c256\n")
    sampler = subprocess.Popen([sys.executable, str(SAMPLER), metrics_url, str(tmp_path),
                                str(serve.pid)])
    try:
        time.sleep(2.5)
    finally:
        sampler.kill()
        sampler.wait()
        import psutil

        for p in [*psutil.Process(serve.pid).children(recursive=True), serve, client, other]:
            p.kill()
        for p in (serve, client, other):
            p.wait()
    by_metric: dict[str, list[float]] = {}
    for row in (line.split() for line in (tmp_path / "kv.tsv").read_text().splitlines()):
        if len(row) == 4:
            by_metric.setdefault(row[2], []).append(float(row[3]))
    assert len(by_metric["api_server_cpu_pct"]) >= 4
    assert reads_busy(by_metric["api_server_cpu_pct"])    # APIServer_0's busy loop, not the idle parent
    assert reads_busy(by_metric["client_cpu_pct"])
    assert max(by_metric["engine_core_cpu_pct"]) < 20
