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
import os

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (KVCacheSpecKind, get_kv_cache_spec_kind,
                                        get_kv_cache_spec_sliding_window)

from ..tree import chunk_namespace
from . import logger
from .kv_cache_manager import ChunkTreeKVCacheManager
from .metrics import TreeMetrics
from .namespace import request_namespace


class ChunkTreeScheduling:
    """What the tree adds to vLLM's scheduler, sync or async (the two classes below)."""

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        _refuse_unsupported(vllm_config, kv_cache_config)
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        # Already the tree where vLLM's KVCacheManager is swapped for it (tests/external).
        if not isinstance(self.kv_cache_manager, ChunkTreeKVCacheManager):
            self.kv_cache_manager = ChunkTreeKVCacheManager(self.kv_cache_manager,
                                                            self.block_size)
        self.tree = self.kv_cache_manager.tree
        self.prefix_aware = os.environ.get("CHUNKATTN_PREFIX_AWARE_SCHEDULING", "1") != "0"
        self.sched_window = int(os.environ.get("CHUNKATTN_SCHED_WINDOW", "256"))
        self.max_wait_steps = int(os.environ.get("CHUNKATTN_SCHED_MAX_WAIT_STEPS", "64"))
        self._first_seen: dict[str, int] = {}
        self._matches: dict[str, list] = {}     # request id -> its last tree match while waiting
        self.tree_metrics = TreeMetrics(self.tree, vllm_config)
        # vLLM 0.32 does not log whether async scheduling is on: serve_ab.sh reads it here.
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


def _refuse_unsupported(vllm_config, kv_cache_config) -> None:
    """The tree needs every slot's token id by the time the step's output arrives (so no
    speculative lookahead), one full-attention KV cache group, and no external KV (connectors)
    or KV events; say so at start-up rather than fail mid-serving."""
    reasons = kv_cache_config_refusals(kv_cache_config) + config_refusals(vllm_config)
    if reasons:
        raise tree_refusal(reasons)


def tree_refusal(reasons: list[str]) -> ValueError:
    return ValueError("the chunk prefix tree KV cache manager (--attention-backend CUSTOM) "
                      f"does not support {', '.join(reasons)}")


def config_refusals(vllm_config) -> list[str]:
    """What the config alone shows the tree cannot serve. Asked first where the config is built
    (plugin/__init__.py: the API server stops before any engine starts), and again here, where a
    scheduler made another way (tests/external) first meets the config."""
    reasons = []
    if vllm_config.speculative_config is not None:
        reasons.append("speculative decoding (lookahead slots have no tokens yet)")
    if vllm_config.kv_transfer_config is not None:
        reasons.append("KV connectors")
    if vllm_config.kv_events_config is not None and \
            vllm_config.kv_events_config.enable_kv_cache_events:
        reasons.append("KV cache events")
    aux = getattr(vllm_config, "aux_output_config", None)         # vLLM 0.33
    if aux is not None and aux.enabled:
        # Its scheduler connector tracks cached prefixes in vLLM's BlockPool, which the tree
        # replaces: it would see no cached block at all.
        reasons.append("auxiliary outputs (--enable-return-routed-experts)")
    return reasons


def kv_cache_config_refusals(kv_cache_config) -> list[str]:
    """What in the KV cache layout alone the tree cannot serve: one full-attention group only."""
    reasons = []
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        reasons.append(f"{len(groups)} KV cache groups (hybrid models)")
    else:
        # One group of windowed layers passes the count; the tree keeps every token's KV.
        spec = groups[0].kv_cache_spec
        window = get_kv_cache_spec_sliding_window(spec) or getattr(spec, "sliding_window", None)
        kind = get_kv_cache_spec_kind(spec)
        if window:
            reasons.append(f"sliding window attention (window {window})")
        elif kind != KVCacheSpecKind.FULL_ATTENTION:
            reasons.append(f"{kind.value} KV cache groups")
    if kv_cache_config.needs_kv_cache_zeroing:
        reasons.append("KV cache blocks that must be zeroed (Mamba or mixed-precision KV)")
    return reasons
