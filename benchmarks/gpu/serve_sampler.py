"""serve_ab.sh's sampler: while a server runs, every 0.25 s, what it holds and what it keeps busy.

    python benchmarks/gpu/serve_sampler.py URL WORK SERVER_PID

Appends `time workload metric value` lines to WORK/kv.tsv, tagged with the workload named in
WORK/current (no line while that is empty: bench() is rewriting it):
  vllm:kv_cache_usage_perc, vllm:num_requests_running   from /metrics
  api_server_cpu_pct    the busiest API server process: the `vllm serve` process, or with
                        --api-server-count N its VLLM::APIServer_i children (GIL-bound: near
                        100 it is saturated, and streams tokens late or in bursts)
  client_cpu_pct        the `vllm bench serve` process sending to this server (one process
                        reading every stream: it can saturate too)
  engine_core_cpu_pct   its EngineCore child: scheduler, plan builds, launches (100 = one core;
                        near 100 also while it spin-waits on the GPU, so alone it says little)
  gpu_busy_pct          NVML's share of its last sample period with a kernel running
Why the last two: at 128 -> 256 concurrent CUSTOM's step time doubled with no more throughput
on an H100; a GPU busy well under 100 % while the engine core is at ~100 % says the
steps wait for the host, not for the GPU. Stock is sampled the same way.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
import urllib.request

KV_METRICS = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running")
PERIOD_S = 0.25


def metric_lines(text: str) -> list[tuple[str, str]]:
    """(name, value) of the KV metrics in a /metrics page (labels dropped). Not
    bench/server_client.scrape: importing vllm_chunkattn loads torch (seconds)."""
    return [(line.split("{")[0].split()[0], line.split()[-1]) for line in text.splitlines()
            if line.startswith(KV_METRICS)]


def titled(server, title: str) -> list:
    """The server's child processes vLLM titled VLLM::<title>... (setproctitle, or their name)."""
    import psutil

    found = []
    for child in server.children(recursive=True):
        try:
            if title in " ".join(child.cmdline()) or title in child.name():
                found.append(child)
        except psutil.Error:
            continue
    return found


def engine_core(server):
    """The server's EngineCore process, or None."""
    return next(iter(titled(server, "EngineCore")), None)


def api_servers(server) -> list:
    """The processes that serve HTTP: vLLM's API server children (--api-server-count > 1; the
    `vllm serve` process then only watches them), else the `vllm serve` process itself."""
    return titled(server, "APIServer") or [server]


def bench_client(url: str) -> list:
    """The processes whose command line is a `vllm bench serve` sending to url: the client and
    the `timeout` serve_ab.sh starts it under (idle; CpuShare keeps the busiest)."""
    import psutil

    return [proc for proc in psutil.process_iter(["cmdline"])
            if url in (cmd := proc.info["cmdline"] or []) and "bench" in cmd and "serve" in cmd]


class CpuShare:
    """A process's CPU % over each sample period (psutil: the first reading of a process only
    starts its interval), the process found again when it is gone (each run has a new client)."""

    def __init__(self, find):
        self.find, self.procs = find, {}

    def read(self) -> float | None:
        import psutil

        found = self.find()
        procs = found if isinstance(found, list) else [found] if found else []
        shares = []
        for p in procs:
            try:
                if p.pid in self.procs:
                    shares.append(self.procs[p.pid].cpu_percent(None))
                else:
                    self.procs[p.pid] = p
                    p.cpu_percent(None)
            except psutil.Error:
                self.procs.pop(p.pid, None)
        return max(shares) if shares else None


def nvml_busy():
    """A function giving the GPU's busy % (NVML utilization.gpu), or None where NVML is absent.
    vLLM carries NVML's bindings (vllm/third_party/pynvml.py): loaded by path, so the sampler
    does not import vLLM; nvidia-ml-py's `pynvml` where that is not there."""
    module = None
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "third_party", "pynvml.py")
        if os.path.exists(path):
            loaded = importlib.util.spec_from_file_location("_sampler_pynvml", path)
            module = sys.modules[loaded.name] = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)      # it looks itself up in sys.modules
    if module is None:
        try:
            import pynvml as module
        except ImportError:
            return None
    try:
        module.nvmlInit()
        handle = module.nvmlDeviceGetHandleByIndex(0)   # serve_ab.sh serves on the first GPU
        module.nvmlDeviceGetUtilizationRates(handle)
    except Exception:                                   # NVMLError: no driver, no GPU
        return None

    def busy():
        try:
            return module.nvmlDeviceGetUtilizationRates(handle).gpu
        except Exception:                               # NVMLError: the GPU fell off the bus
            return None
    return busy


def sample_forever(url: str, work: str, server_pid: int, period_s: float = PERIOD_S) -> None:
    import psutil

    server = psutil.Process(server_pid)
    api = CpuShare(lambda: api_servers(server))
    base = url.rsplit("/metrics", 1)[0]
    client = CpuShare(lambda: bench_client(base))
    core = CpuShare(lambda: engine_core(server))
    busy = nvml_busy()
    with open(os.path.join(work, "kv.tsv"), "a") as out:
        while True:
            try:
                text = urllib.request.urlopen(url, timeout=2).read().decode()
                with open(os.path.join(work, "current")) as f:
                    workload = f.read().strip()
                values = metric_lines(text)
                for name, share in (("api_server_cpu_pct", api.read()),
                                    ("client_cpu_pct", client.read()),
                                    ("engine_core_cpu_pct", core.read())):
                    if share is not None:
                        values.append((name, f"{share:.1f}"))
                if busy is not None and (pct := busy()) is not None:
                    values.append(("gpu_busy_pct", str(pct)))
                now = f"{time.time():.2f}"
                for name, value in values if workload else []:
                    out.write(f"{now} {workload} {name} {value}\n")
                out.flush()
            except (OSError, psutil.Error):
                pass
            time.sleep(period_s)


if __name__ == "__main__":
    sample_forever(sys.argv[1], sys.argv[2], int(sys.argv[3]))
