"""Chunk prefix tree metrics, gathered in EngineCore by ChunkAttnScheduler.

Per decode step (requests scheduled with one token, as the worker's TPP decode batch):
decode rows, KV tokens and shared KV tokens as the tree predicts them (the worker's plan is built
from the same block tables, so these must equal the worker's plugin/sharing_stats.py counts).
Gauges from the tree: live shared tokens = KV memory saved vs. no sharing, in-use / cached /
free chunks, prefix hit rate, evictions.

Outputs: a periodic `chunkattn tree:` log line (CHUNKATTN_STATS_INTERVAL_S, default 10 s) and,
when CHUNKATTN_TREE_STATS_FILE is set, that file as JSON (tests and benchmarks read it).
CHUNKATTN_DEBUG_TREE=1 also runs the tree's invariant checker every step.
vLLM's own `prefix_cache_stats` (vllm:prefix_cache_queries/hits) keep being filled by the manager.

Prometheus (plugin/prometheus.py): the tree's gauges, evictions and preemptions are written
every step, after each step's results and after aborts, so /metrics is never a step behind; the
decode KV counters there come from the worker's plans (plugin/sharing_stats.py), which cost
nothing extra.
"""
from __future__ import annotations

import json
import os
import time

from . import logger
from .prometheus import MetricsWriter


class TreeMetrics:
    PUBLISHED = ("live_shared_kv_tokens", "in_use_blocks", "cached_blocks", "free_blocks",
                 "evictions", "preemptions")

    def __init__(self, tree, vllm_config=None):
        self.tree = tree
        self.interval_s = float(os.environ.get("CHUNKATTN_STATS_INTERVAL_S", "10"))
        self.path = os.environ.get("CHUNKATTN_TREE_STATS_FILE")
        self.debug = os.environ.get("CHUNKATTN_DEBUG_TREE", "0") == "1"
        # The exact per-step sharing costs O(chunks of the decode batch): only when asked for.
        self.exact = bool(self.path) or self.debug
        self.steps = self.decode_steps = self.decode_rows = 0
        self.decode_kv_tokens = self.decode_shared_kv_tokens = 0
        self.max_decode_shared_kv_tokens = 0
        self.invariant_checks = self.preemptions = 0
        self._last = time.monotonic()
        self._writer = MetricsWriter.for_process(vllm_config, self.PUBLISHED)

    def on_step(self, num_scheduled_tokens: dict[str, int], requests) -> None:
        self.steps += 1
        if self.debug:
            self.tree.check_invariants()
            self.invariant_checks += 1
        if self.exact:
            decode_ids = [rid for rid, n in num_scheduled_tokens.items() if n == 1]
            if decode_ids:
                self._record_decode(decode_ids)
        self.publish()
        if self.interval_s == 0 or time.monotonic() - self._last >= self.interval_s:
            self.flush()

    def _record_decode(self, decode_ids: list[str]) -> None:
        tree = self.tree
        nodes, _ = tree.sharing_groups(decode_ids)
        shared = sum((len(rows) - 1) * len(blocks) for blocks, rows in nodes) * tree.block_size
        self.decode_steps += 1
        self.decode_rows += len(decode_ids)
        self.decode_kv_tokens += sum(tree.num_tokens(rid) for rid in decode_ids)
        self.decode_shared_kv_tokens += shared
        self.max_decode_shared_kv_tokens = max(self.max_decode_shared_kv_tokens, shared)

    def snapshot(self) -> dict:
        s = self.tree.stats()
        return {
            "steps": self.steps, "decode_steps": self.decode_steps,
            "decode_rows": self.decode_rows, "decode_kv_tokens": self.decode_kv_tokens,
            "decode_shared_kv_tokens": self.decode_shared_kv_tokens,
            "max_decode_shared_kv_tokens": self.max_decode_shared_kv_tokens,
            "live_shared_kv_tokens": s.num_shared_tokens,     # = KV memory saved, in tokens
            "in_use_blocks": s.num_in_use_blocks, "cached_blocks": s.num_cached_blocks,
            "free_blocks": s.num_free_blocks, "pool_blocks": self.tree.pool_size,
            "num_live_seqs": len(self.tree.seqs),
            "hit_tokens": s.num_hit_tokens, "query_tokens": s.num_query_tokens,
            "hit_rate": s.hit_rate, "evictions": s.num_evictions,
            "invariant_checks": self.invariant_checks, "preemptions": self.preemptions,
            "resolved_pending_tokens": self.tree.num_resolved_tokens,
        }

    def publish(self) -> None:
        if self._writer:
            self._writer.write(self.snapshot())

    def maybe_flush(self) -> None:
        if time.monotonic() - self._last >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        self._last = time.monotonic()
        d = self.snapshot()
        logger.info(
            "chunkattn tree: %d live seqs, chunks in use=%d cached=%d free=%d, KV saved by "
            "sharing=%d tokens, prefix hit rate=%.1f%%, evictions=%d",
            d["num_live_seqs"], d["in_use_blocks"], d["cached_blocks"], d["free_blocks"],
            d["live_shared_kv_tokens"], 100 * d["hit_rate"], d["evictions"])
        if self.path:
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(d, f)
            os.replace(tmp, self.path)

