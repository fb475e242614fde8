"""Hybrid KV cache groups with the chunk prefix tree: a full-attention group and one or two
sliding-window groups in one block pool (vLLM's layout for gpt-oss and Gemma 2/3). vLLM's
Scheduler with its own KVCacheManager and ChunkAttnScheduler side by side, sync and async, on the
same sampled tokens: every step schedules the same tokens, every request gets the same output and
the same prefix hit, and the KV cache usage vLLM reports is the same after every step, so the tree
frees windowed blocks when stock does and holds exactly stock's memory; in a pool too small for the
batch both preempt alike. Every step, each running request's windowed blocks that its next
token's window reads are live and held by no one else."""
import zlib

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        SlidingWindowSpec)
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from vllm_chunkattn.plugin.scheduler import ChunkAttnAsyncScheduler, ChunkAttnScheduler
from scheduler_steps import run_waves, scheduler_config

pytestmark = pytest.mark.vllm
BS, WINDOW = 16, 40


def make_scheduler(cls, monkeypatch, num_blocks: int, num_window_groups: int,
                   async_scheduling: bool):
    monkeypatch.setenv("CHUNKATTN_PREFIX_AWARE_SCHEDULING", "0")     # FCFS in both
    monkeypatch.setenv("CHUNKATTN_DEBUG_TREE", "1")                # invariants every step
    config = scheduler_config(BS, num_blocks, 96, 8, async_scheduling)
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=64,
                               dtype=torch.float32, sliding_window=WINDOW)
    groups = [KVCacheGroupSpec([f"layer.{g}.sliding"], window) for g in range(num_window_groups)]
    groups.insert(1 if num_window_groups > 1 else 0, KVCacheGroupSpec(["layer.full"], full))
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return cls(config, kv, StructuredOutputManager(config), block_size=BS)


def sampled(request: Request) -> int:
    """A deterministic 'model', the same in every process (no str hash seed)."""
    return 3 + zlib.crc32(f"{request.request_id}:{request.num_tokens}".encode()) % 1000


def run(scheduler, waves, async_scheduling: bool) -> dict:
    check = check_window_blocks_live if hasattr(scheduler, "tree") else None
    return run_waves(scheduler, waves, BS, sampled, async_scheduling, after_schedule=check)


def check_window_blocks_live(scheduler) -> None:
    """The blocks a running request's next token reads in each window group: non-null, not free,
    and another request's only where both hold the same full-attention chunk there."""
    manager, tree = scheduler.kv_cache_manager, scheduler.tree
    window, free = manager.window, set(tree.free_block_ids)
    owner: dict[int, tuple] = {}
    for rid, seq in tree.seqs.items():
        request = scheduler.requests[rid]
        first = window.skipped_chunks(request.num_computed_tokens)
        rows = manager.get_block_ids(rid)
        full = rows[manager.full_group]
        for g, row in enumerate(rows):
            assert len(row) == len(full), (rid, g)
            if g == manager.full_group:
                continue
            for pos in range(first, len(row)):
                block = row[pos]
                assert block != 0 and block not in free, (rid, g, pos, block)
                key = (g, pos, full[pos] if pos < len(seq.chunks) else ("tail", rid))
                assert owner.setdefault(block, key) == key, (rid, g, pos, block)


def waves(seed: int = 0) -> list:
    """A system prompt longer than the window, sharers admitted in one wave, a follow-up turn
    into a finished request's decoded tokens, and a late sharer of the prefix alone."""
    system = [3 + (seed * 13 + 7 * k) % 900 for k in range(5 * BS + 3)]
    first = [(f"a{i}", system + [3 + (i * 31 + k) % 900 for k in range(9 + 5 * i)], 30 + 7 * i)
             for i in range(5)]
    late = [("c0", system[:4 * BS + 5] + [11, 12, 13], 12)]
    return [first, late]


@pytest.mark.parametrize("num_window_groups", [1, 2])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_hybrid_groups_are_scheduled_and_freed_as_stock(monkeypatch, num_window_groups,
                                                        async_scheduling):
    stock_cls, tree_cls = ((AsyncScheduler, ChunkAttnAsyncScheduler) if async_scheduling
                           else (Scheduler, ChunkAttnScheduler))
    results = {}
    for name, cls in (("stock", stock_cls), ("tree", tree_cls)):
        scheduler = make_scheduler(cls, monkeypatch, 200, num_window_groups, async_scheduling)
        first, late = waves()
        r1 = run(scheduler, [first, late], async_scheduling)
        turn = [("b0", first[1][1] + r1["outputs"]["a1"] + [5, 6, 7], 8)]
        results[name] = (r1, run(scheduler, [turn], async_scheduling))
        if name == "tree":
            assert scheduler.tree_metrics.invariant_checks > 0
            assert scheduler.tree.stats().num_in_use_blocks == 0
    for stock, tree in zip(results["stock"], results["tree"]):
        assert tree["steps"] == stock["steps"]
        assert tree["outputs"] == stock["outputs"]
        assert tree["hits"] == stock["hits"]
        assert tree["usage"] == stock["usage"]
    r1, r2 = results["tree"]
    assert r1["hits"]["a1"] >= 5 * BS and r1["hits"]["c0"] == 4 * BS, r1["hits"]
    assert r2["hits"]["b0"] > len(waves()[0][1][1]), r2["hits"]     # into decoded tokens
    # Windows freed what fell out of them: fewer blocks than full-length windowed KV.
    full_length = (1 + num_window_groups) * max(
        sum(-(-(len(p) + m) // BS) for _, p, m in waves()[0]), 1)
    assert max(r1["usage"]) * 199 < full_length


@pytest.mark.parametrize("num_blocks", [20, 30, 36])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_hybrid_groups_preempt_no_more_than_stock_in_a_small_pool(monkeypatch, async_scheduling,
                                                                 num_blocks):
    """Pools too small for the batch: the same tokens, never more preemptions than stock. In
    30 and 36 blocks every step is stock's; in 20 the two evict in another order (stock's pool
    queue mixes both groups' blocks; the tree reclaims released window blocks before chunks)
    and the tree preempts less."""
    stock_cls, tree_cls = ((AsyncScheduler, ChunkAttnAsyncScheduler) if async_scheduling
                           else (Scheduler, ChunkAttnScheduler))
    results = {}
    for name, cls in (("stock", stock_cls), ("tree", tree_cls)):
        scheduler = make_scheduler(cls, monkeypatch, num_blocks, 1, async_scheduling)
        results[name] = run(scheduler, waves(1)[:1], async_scheduling)
    stock, tree = results["stock"], results["tree"]
    assert stock["preempted"] > 0, "the pool was not too small"
    assert tree["outputs"] == stock["outputs"]
    assert tree["preempted"] <= stock["preempted"]
    if num_blocks >= 30:
        assert tree["steps"] == stock["steps"]
        assert tree["preempted"] == stock["preempted"]
