"""The sharing metrics on vLLM's own /metrics, with no set-up by the user.

How vLLM 0.32 builds /metrics: the API server serves `get_prometheus_registry()`, which is
prometheus_client's process-global REGISTRY unless PROMETHEUS_MULTIPROC_DIR is set; vLLM sets
that only for `--api-server-count > 1` (then every API server reads the directory through a
MultiProcessCollector). Our numbers live elsewhere: the tree in EngineCore (plugin/metrics.py),
the decode plans in the workers (plugin/sharing_stats.py), both other processes.

Why this way: the stat-logger plugin hook (`vllm.stat_logger_plugins`) runs in the API server but
only receives SchedulerStats, a typed struct with no extension field (msgspec drops anything
else on the way), so it could not carry these numbers; and an installed one turns engine stats
on for every server, flag or not, even under --disable-log-stats. Setting
PROMETHEUS_MULTIPROC_DIR ourselves would come too late: the API server's prometheus_client picks
in-memory values at import, so vLLM's own metrics would vanish.
Prometheus' multi-process files are the channel built for exactly this, so: EngineCore and one
worker per engine write their current values each step into prometheus_client's mmap files
(`gauge_mostrecent_*.db`, `counter_*.db`, written with prometheus_client.mmap_dict, the module
its own multi-process values use; ~5 us for 8 values), in the directory named
by CHUNKATTN_METRICS_DIR. `expose()` picks that directory in the process that builds the config
(the API server; children inherit the variable): vLLM's PROMETHEUS_MULTIPROC_DIR when set (its
/metrics already reads it), else a private temporary one that a MultiProcessCollector adds to
REGISTRY. Nothing is set up without --attention-backend CUSTOM.
"""
from __future__ import annotations

import os
import tempfile
import time

ENV = "CHUNKATTN_METRICS_DIR"

METRICS = {   # key in the writers' snapshots -> (name, type, help)
    "kv_tokens": ("chunkattn:decode_kv_tokens", "counter",
                  "KV tokens read by decode attention (sum of the served decode rows' lengths)"),
    "shared_kv_tokens": ("chunkattn:decode_shared_kv_tokens", "counter",
                         "Of the decode KV tokens, those served by a chunk read once for several "
                         "rows: sum over shared chunks of (sharers - 1) * tokens"),
    "live_shared_kv_tokens": ("chunkattn:kv_saved_tokens", "gauge",
                              "KV tokens stored once but used by several live sequences"),
    "in_use_blocks": ("chunkattn:chunks_in_use", "gauge",
                      "Chunks (KV blocks) held by live sequences"),
    "cached_blocks": ("chunkattn:chunks_cached", "gauge", "Released chunks kept for prefix hits"),
    "free_blocks": ("chunkattn:chunks_free", "gauge", "Chunks holding no KV"),
    "evictions": ("chunkattn:chunk_evictions", "counter", "Cached chunks evicted"),
    "preemptions": ("chunkattn:preemptions", "counter",
                    "Requests preempted by the tree scheduler for lack of free chunks"),
}

_exposed_dir: tempfile.TemporaryDirectory | str | None = None
# One MmapedDict per file: EngineCore and a worker may share a process (TP=1), and two would
# overwrite each other's entries.
_files: dict[str, object] = {}


def expose() -> None:
    """In the process that builds the config: choose the directory, serve it on /metrics."""
    global _exposed_dir
    if _exposed_dir is not None:
        return
    multiproc = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if multiproc:
        _exposed_dir = multiproc
    else:
        from prometheus_client import REGISTRY
        from prometheus_client.multiprocess import MultiProcessCollector

        _exposed_dir = tempfile.TemporaryDirectory(prefix="chunkattn-metrics-")   # gone at exit
        MultiProcessCollector(REGISTRY, path=_exposed_dir.name)
    # Overrides a value inherited from a parent that built its own engine.
    os.environ[ENV] = multiproc or _exposed_dir.name


class MetricsWriter:
    """One process's current values of some METRICS, as MultiProcessCollector reads them."""

    def __init__(self, path: str, keys, model_name: str, engine: int):
        from prometheus_client.mmap_dict import MmapedDict, mmap_key

        # "chunkattn-<pid>": never the file of a prometheus_client metric of this process.
        tag = f"chunkattn-{os.getpid()}"
        self._slots = []
        for key in keys:
            name, kind, doc = METRICS[key]
            prefix = "gauge_mostrecent" if kind == "gauge" else "counter"
            file = os.path.join(path, f"{prefix}_{tag}.db")
            if file not in _files:
                _files[file] = MmapedDict(file)
            sample = name + "_total" if kind == "counter" else name
            slot = mmap_key(name, sample, ["model_name", "engine"], [model_name, str(engine)], doc)
            _files[file].read_value(slot)     # creates the entry now: later writes never grow
            self._slots.append((key, _files[file], slot))

    @classmethod
    def for_process(cls, vllm_config, keys) -> "MetricsWriter | None":
        path = os.environ.get(ENV)
        if not path or vllm_config is None or not os.path.isdir(path):
            return None               # not under a config built with the flag (unit tests)
        return cls(path, keys, str(vllm_config.model_config.served_model_name),
                   vllm_config.parallel_config.data_parallel_rank)

    def write(self, values: dict) -> None:
        now = time.time()
        for key, file, slot in self._slots:
            file.write_value(slot, float(values[key]), now)
