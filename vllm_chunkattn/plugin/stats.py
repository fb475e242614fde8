"""What ChunkAttention counts while serving, and where those numbers go.

Two sets of counters, in two processes:
  SharingStats (one per worker, SHARING_STATS): the decode batches the worker planned: decode
    rows, KV tokens read and those served by shared chunks, plan builds.
  TreeMetrics (EngineCore, in ChunkAttnScheduler): the chunk prefix tree's state: live shared
    tokens (= KV memory saved vs. no sharing), in-use / cached / free chunks, prefix hit rate,
    evictions, preemptions; and, when asked for, the tree's own count of each decode step's
    sharing (the worker's plan is built from the same block tables, so the two must agree).

Counted once per engine and step, whatever the parallelism. Every tensor-parallel rank and every
pipeline stage of an engine plans the same decode batch (a stage builds attention metadata for
all of the step's rows, for its own layers), and each counts a step once, not once per layer;
only the engine's first rank (TP rank 0 of the first PP stage) writes the metrics and the stats
file, so neither holds a step twice. Each data-parallel rank is an engine of its own (its own
EngineCore, tree and workers): its values carry its index within the deployment, the `engine`
label vLLM's own per-engine series on /metrics carry (`engine_index`), and its stats files are
its own (`engine_file`).

Outputs of both: a periodic log line (`chunkattn decode:` / `chunkattn tree:`, every
CHUNKATTN_STATS_INTERVAL_S, 0 = every step) and, when CHUNKATTN_STATS_FILE /
CHUNKATTN_TREE_STATS_FILE is set, that file as JSON, replaced atomically at each flush (benchmarks
and tests read it from another process). CHUNKATTN_DEBUG_TREE=1 also runs the tree's invariant
checker every step. vLLM's own `prefix_cache_stats` (vllm:prefix_cache_queries/hits) keep being
filled by the KV cache manager.

And every step, with no set-up, vLLM's own /metrics (`chunkattn:*`, METRICS below). How vLLM
0.32 builds /metrics: the API server serves `get_prometheus_registry()`, which is
prometheus_client's process-global REGISTRY unless PROMETHEUS_MULTIPROC_DIR is set; vLLM sets
that only for `--api-server-count > 1` (then every API server reads the directory through a
MultiProcessCollector). Our numbers live in other processes than the API server.

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
REGISTRY. Nothing is set up without --attention-backend CUSTOM. The tree's gauges, evictions and
preemptions are written every step, after each step's results and after aborts, so /metrics is
never a step behind; the decode KV counters come from the worker's plans, which cost nothing
extra.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from .. import envs
from . import logger

# --- Prometheus: /metrics ---------------------------------------------------------------------

METRICS = {   # key in the counters' dicts -> (name, type, help)
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


def engine_index(vllm_config) -> int:
    """The engine's index within its deployment, as vLLM's own metrics label it: its DP rank.
    Not parallel_config.data_parallel_rank, which vLLM resets to 0 on every rank of a dense
    model (each rank an independent engine); data_parallel_index keeps the rank."""
    return vllm_config.parallel_config.data_parallel_index


def engine_file(path, engine: int) -> Path | None:
    """The stats file of one engine: DP rank 0 (and any deployment without DP) writes `path`
    itself, rank N > 0 `path` with `.dpN` before its suffix (stats.json -> stats.dp1.json)."""
    if path is None or engine == 0:
        return path
    path = Path(path)
    return path.with_name(f"{path.stem}.dp{engine}{path.suffix}")


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
    envs.export("METRICS_DIR", multiproc or _exposed_dir.name)


class MetricsWriter:
    """One process's current values of some METRICS, as MultiProcessCollector reads them."""

    def __init__(self, path, keys, model_name: str, engine: int):
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
        path = envs.METRICS_DIR
        if not path or vllm_config is None or not os.path.isdir(path):
            return None               # not under a config built with the flag (unit tests)
        return cls(path, keys, str(vllm_config.model_config.served_model_name),
                   engine_index(vllm_config))

    def write(self, values: dict) -> None:
        now = time.time()
        for key, file, slot in self._slots:
            file.write_value(slot, float(values[key]), now)


# --- the periodic log line and JSON file --------------------------------------------------------

def write_json_atomically(path, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)   # readers never see a half-written file


class PeriodicStats:
    """Counters flushed every CHUNKATTN_STATS_INTERVAL_S: a log line, and the JSON file at `path`
    when one is set. Subclasses give as_dict() and log()."""

    def __init__(self, path):
        self.interval_s = envs.STATS_INTERVAL_S
        self.path = path
        self._last = time.monotonic()

    def as_dict(self) -> dict:
        raise NotImplementedError

    def log(self, d: dict) -> None:
        raise NotImplementedError

    def maybe_flush(self) -> None:
        if time.monotonic() - self._last >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        self._last = time.monotonic()
        d = self.as_dict()
        self.log(d)
        if self.path:
            write_json_atomically(self.path, d)


# --- the counters -------------------------------------------------------------------------------

class SharingStats(PeriodicStats):
    """One worker's decode sharing counters (the worker is its own process)."""

    COUNTERS = ("decode_steps", "decode_rows", "kv_tokens", "shared_kv_tokens",
                "max_shared_kv_tokens_per_step", "plan_builds", "mixed_steps")

    def __init__(self):
        super().__init__(envs.STATS_FILE)
        self.decode_steps = self.decode_rows = self.kv_tokens = self.shared_kv_tokens = 0
        self.max_shared_kv_tokens_per_step = 0
        self.plan_builds = 0
        self.mixed_steps = 0          # steps with decode rows and (chunked-)prefill rows
        self._writer = None

    def publish_to_metrics(self, vllm_config) -> None:
        """Binds these counters to the worker's engine. Every TP rank and PP stage of an engine
        plans the same decode batch: the first one speaks for all, on /metrics and in the
        engine's stats file; the others still count and log, and write neither."""
        from vllm.distributed.parallel_state import (get_pp_group,
                                                     get_tensor_model_parallel_rank,
                                                     model_parallel_is_initialized)
        first = not model_parallel_is_initialized() or (
            get_tensor_model_parallel_rank() == 0 and get_pp_group().is_first_rank)
        self.path = engine_file(envs.STATS_FILE, engine_index(vllm_config)) if first else None
        if self._writer is None and first:
            self._writer = MetricsWriter.for_process(vllm_config,
                                                     ("kv_tokens", "shared_kv_tokens"))

    def record(self, num_rows: int, kv_tokens: int, shared_kv_tokens: int, plan_builds: int,
               with_prefill: bool):
        self.decode_steps += 1
        self.mixed_steps += with_prefill
        self.decode_rows += num_rows
        self.kv_tokens += kv_tokens
        self.shared_kv_tokens += shared_kv_tokens
        self.max_shared_kv_tokens_per_step = max(self.max_shared_kv_tokens_per_step,
                                                 shared_kv_tokens)
        self.plan_builds = plan_builds
        if self._writer:
            self._writer.write(vars(self))     # the writer reads its own keys: no copy per step
        self.maybe_flush()

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.COUNTERS}

    def log(self, d: dict) -> None:
        saved = d["shared_kv_tokens"] / d["kv_tokens"] if d["kv_tokens"] else 0.0
        logger.info("chunkattn decode: steps=%d rows=%d kv_tokens=%d shared_kv_tokens=%d (%.1f%% "
                    "of decode KV reads served by shared chunks), plan builds=%d",
                    d["decode_steps"], d["decode_rows"], d["kv_tokens"], d["shared_kv_tokens"],
                    100 * saved, d["plan_builds"])


SHARING_STATS = SharingStats()


class TreeMetrics(PeriodicStats):
    """The chunk prefix tree's counters, gathered in EngineCore by ChunkAttnScheduler. A decode
    step is the requests the worker's TPP decode batch holds (decode_threshold)."""

    PUBLISHED = ("live_shared_kv_tokens", "in_use_blocks", "cached_blocks", "free_blocks",
                 "evictions", "preemptions")

    def __init__(self, tree, vllm_config=None):
        super().__init__(envs.TREE_STATS_FILE if vllm_config is None else
                         engine_file(envs.TREE_STATS_FILE, engine_index(vllm_config)))
        self.tree = tree
        self.debug = envs.DEBUG_TREE
        # The exact per-step sharing costs O(chunks of the decode batch): only when asked for.
        self.exact = bool(self.path) or self.debug
        # The worker's decode rows: requests of at most 1 + num_speculative_tokens query tokens
        # (verify rows, and prefill chunks as short), as its builder's reorder_batch_threshold.
        spec = getattr(vllm_config, "speculative_config", None)
        self.decode_threshold = 1 + ((spec.num_speculative_tokens or 0) if spec else 0)
        self.steps = self.decode_steps = self.decode_rows = 0
        self.decode_kv_tokens = self.decode_shared_kv_tokens = 0
        self.max_decode_shared_kv_tokens = 0
        self.invariant_checks = self.preemptions = 0
        self._writer = MetricsWriter.for_process(vllm_config, self.PUBLISHED)
        self._last_published: dict | None = None

    def on_step(self, num_scheduled_tokens: dict[str, int], requests=None) -> None:
        """requests: the scheduler's, by id (their num_computed_tokens already count this step's
        tokens, as the worker's seq_lens do); None: the tree's token counts instead."""
        self.steps += 1
        if self.debug:
            self.tree.check_invariants()
            self.invariant_checks += 1
        if self.exact:
            decodes = {rid: n for rid, n in num_scheduled_tokens.items()
                       if n <= self.decode_threshold}
            if decodes:
                self._record_decode(decodes, requests)
        self.publish()
        self.maybe_flush()

    def _record_decode(self, decodes: dict[str, int], requests) -> None:
        """As the worker counts its TPP rows (plan/query_rows.py): one per query token; a node's
        blocks are read once for all its sharers' query tokens, and a row's own full blocks past
        its shared prefix (at its first query token) once for its query tokens."""
        tree, bs = self.tree, self.tree.block_size
        ids = list(decodes)
        nodes, num_shared = tree.sharing_groups(ids)
        tokens = [decodes[rid] for rid in ids]
        seq_lens = [tree.num_tokens(rid) if requests is None else
                    requests[rid].num_computed_tokens for rid in ids]
        first_lens = [n - q + 1 for n, q in zip(seq_lens, tokens)]
        shared_blocks = sum((sum(tokens[r] for r in rows) - 1) * len(blocks)
                            for blocks, rows in nodes)
        shared_blocks += sum((q - 1) * max(0, first // bs - depth)
                             for q, first, depth in zip(tokens, first_lens, num_shared))
        shared = shared_blocks * bs
        self.decode_steps += 1
        self.decode_rows += sum(tokens)
        self.decode_kv_tokens += sum(q * first + q * (q - 1) // 2
                                     for q, first in zip(tokens, first_lens))
        self.decode_shared_kv_tokens += shared
        self.max_decode_shared_kv_tokens = max(self.max_decode_shared_kv_tokens, shared)

    def _published(self, s) -> dict:
        """The PUBLISHED values, from the tree's stats `s`."""
        return {"live_shared_kv_tokens": s.num_shared_tokens,    # = KV memory saved, in tokens
                "in_use_blocks": s.num_in_use_blocks, "cached_blocks": s.num_cached_blocks,
                "free_blocks": s.num_free_blocks, "evictions": s.num_evictions,
                "preemptions": self.preemptions}

    def as_dict(self) -> dict:
        s = self.tree.stats()
        return {
            "steps": self.steps, "decode_steps": self.decode_steps,
            "decode_rows": self.decode_rows, "decode_kv_tokens": self.decode_kv_tokens,
            "decode_shared_kv_tokens": self.decode_shared_kv_tokens,
            "max_decode_shared_kv_tokens": self.max_decode_shared_kv_tokens,
            **self._published(s), "pool_blocks": self.tree.pool_size,
            "num_live_seqs": len(self.tree.seqs),
            "hit_tokens": s.num_hit_tokens, "query_tokens": s.num_query_tokens,
            "hit_rate": s.hit_rate, "invariant_checks": self.invariant_checks,
            "resolved_pending_tokens": self.tree.num_resolved_tokens,
        }

    def publish(self) -> None:
        """Writes the gauges and counters /metrics shows, when one of them changed (twice a step
        and after aborts: unchanged values are not rewritten)."""
        if self._writer:
            values = self._published(self.tree.stats())
            if values != self._last_published:
                self._writer.write(values)
                self._last_published = values

    def log(self, d: dict) -> None:
        logger.info(
            "chunkattn tree: %d live seqs, chunks in use=%d cached=%d free=%d, KV saved by "
            "sharing=%d tokens, prefix hit rate=%.1f%%, evictions=%d",
            d["num_live_seqs"], d["in_use_blocks"], d["cached_blocks"], d["free_blocks"],
            d["live_shared_kv_tokens"], 100 * d["hit_rate"], d["evictions"])
