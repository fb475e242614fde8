"""vLLM's Scheduler with the chunk prefix tree as KV cache manager, and prefix-aware admission.

Selected automatically by `--attention-backend CUSTOM` (see `use_tree_scheduler` in
plugin/__init__.py, run from the platform's config hook): one flag, no `--scheduler-cls`.

Prefix-aware admission (CHUNKATTN_PREFIX_AWARE_SCHEDULING=0 turns it off): before each step the
head of the waiting queue (CHUNKATTN_SCHED_WINDOW requests) is reordered so that requests
sharing the longest prefix with the tree (running or cached chunks) go first, and requests
sharing their first chunk with each other are admitted together; either way sharers decode in
the same steps and read their shared chunks once. A request that has waited
CHUNKATTN_SCHED_MAX_WAIT_STEPS steps goes ahead of every reordered one, in arrival order, so
no request starves. Only the FCFS policy is reordered (priority scheduling keeps its order).
"""
from __future__ import annotations

import itertools

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler

from .. import envs
from ..tree import chunk_namespace
from . import logger
from .kv_cache_manager import ChunkTreeKVCacheManager
from .stats import TreeMetrics
from .namespace import request_namespace
from .support import refuse_tree_unsupported


class ChunkTreeScheduling:
    """What the tree adds to vLLM's scheduler, sync or async (the two classes below)."""

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        refuse_tree_unsupported(vllm_config, kv_cache_config)
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        # Already the tree where vLLM's KVCacheManager is swapped for it (tests/external).
        if not isinstance(self.kv_cache_manager, ChunkTreeKVCacheManager):
            self.kv_cache_manager = ChunkTreeKVCacheManager(self.kv_cache_manager,
                                                            self.block_size)
        self.tree = self.kv_cache_manager.tree
        self.prefix_aware = envs.PREFIX_AWARE_SCHEDULING
        self.sched_window = envs.SCHED_WINDOW
        self.max_wait_steps = envs.SCHED_MAX_WAIT_STEPS
        self._first_seen: dict[str, int] = {}
        self._matches: dict[str, list] = {}     # request id -> its last tree match while waiting
        self.tree_metrics = TreeMetrics(self.tree, vllm_config)
        # vLLM 0.32 does not log whether async scheduling is on; this line lets an operator (and
        # a benchmark reading the server log) see it.
        logger.info("chunk prefix tree is the KV cache manager: %d blocks of %d tokens, "
                    "prefix-aware scheduling %s, async scheduling %s", self.tree.pool_size,
                    self.block_size, "on" if self.prefix_aware else "off",
                    "on" if isinstance(self, AsyncScheduler) else "off")

    def schedule(self, *args, **kwargs):
        if (self.prefix_aware and len(self.waiting) > 1
                and isinstance(self.waiting, FCFSRequestQueue)
                and len(self.running) < self.max_num_running_reqs):
            self._order_waiting()
        output = super().schedule(*args, **kwargs)
        self.tree_metrics.on_step(output.num_scheduled_tokens, self.requests)
        return output

    def _preempt_request(self, *args, **kwargs):
        self.tree_metrics.preemptions += 1
        return super()._preempt_request(*args, **kwargs)

    def update_from_output(self, *args, **kwargs):
        outputs = super().update_from_output(*args, **kwargs)
        self.tree_metrics.publish()         # finished requests are released by now
        if self.tree_metrics.interval_s == 0:
            self.tree_metrics.flush()
        return outputs

    def finish_requests(self, *args, **kwargs):
        out = super().finish_requests(*args, **kwargs)
        self.tree_metrics.publish()         # aborts free chunks between steps too
        return out

    def make_stats(self, *args, **kwargs):
        stats = super().make_stats(*args, **kwargs)
        self.tree_metrics.maybe_flush()
        return stats

    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        ok = super().reset_prefix_cache(*args, **kwargs)
        self.tree_metrics.publish()
        self.tree_metrics.flush()
        return ok

    def _order_waiting(self) -> None:
        """Longest tree match first, first-chunk sharers together, starving requests first."""
        step, bs, tree = self.current_step, self.block_size, self.tree
        window = list(itertools.islice(self.waiting, self.sched_window))
        seen, matches = self._first_seen, self._matches
        self._first_seen = seen = {r.request_id: seen.get(r.request_id, step) for r in window}
        self._matches = matches = {r.request_id: matches.get(r.request_id, ()) for r in window}
        group_of: dict[tuple, int] = {}
        keys = []
        for i, r in enumerate(window):
            if step - seen[r.request_id] >= self.max_wait_steps:
                keys.append((0, 0, 0, i))               # starving: FCFS, ahead of everyone
                continue
            ns = request_namespace(r)
            tokens = r.all_token_ids
            # Extends the request's match of the last step: a lookup per new chunk, not per chunk.
            matches[r.request_id] = matched = tree.match_prefix(
                tokens, ns, r.num_tokens - 1, previous=matches[r.request_id]) if tokens else []
            hit = len(matched)
            first_chunk = (chunk_namespace(ns, 0, bs), tuple(tokens[:bs]))
            group = group_of.setdefault(first_chunk, i) if len(tokens) > bs else i
            keys.append((1, -hit, group, i))
        order = sorted(range(len(window)), key=keys.__getitem__)
        if order == list(range(len(window))):
            return
        rest = list(itertools.islice(self.waiting, len(window), None))
        self.waiting.clear()
        self.waiting.extend(window[i] for i in order)
        self.waiting.extend(rest)


class ChunkAttnScheduler(ChunkTreeScheduling, Scheduler):
    pass


class ChunkAttnAsyncScheduler(ChunkTreeScheduling, AsyncScheduler):
    """vLLM's default on GPU: step N+1 is scheduled while step N runs; the tree holds the slot
    of each token not sampled yet as pending (kv_cache_manager.py)."""
