"""Async scheduling with the chunk prefix tree: vLLM's AsyncScheduler (async_scheduling set on the
scheduler config directly; vLLM's CPU platform would turn it off) schedules step N+1 before step
N's sampled tokens arrive, so the tree holds those slots as pending and writes the ids later.
Driven like EngineCore's batch queue, side by side with stock vLLM's AsyncScheduler and its own
KVCacheManager, on the same sampled tokens: every step schedules the same tokens, every request
gets the same output, the tree's blocks hold exactly each request's tokens, and a follow-up turn
(prompt = an earlier prompt + its output) hits the same prefix in both."""

import pytest

pytest.importorskip("vllm")

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from vllm_chunkattn.plugin.namespace import request_namespace
from vllm_chunkattn.plugin.scheduler import ChunkAttnAsyncScheduler
from vllm_chunkattn.tree import PENDING
from scheduler_steps import run_waves, scheduler_config

pytestmark = pytest.mark.vllm
BS, NUM_BLOCKS = 16, 48


def make_scheduler(cls, monkeypatch, prefix_aware: bool = False):
    # FCFS in both by default: the same order
    monkeypatch.setenv("CHUNKATTN_PREFIX_AWARE_SCHEDULING", "1" if prefix_aware else "0")
    monkeypatch.setenv("CHUNKATTN_DEBUG_TREE", "1")                # invariants every step
    config = scheduler_config(BS, NUM_BLOCKS, 256, 16, async_scheduling=True)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    return cls(config, kv, StructuredOutputManager(config), block_size=BS)


def sampled(request: Request) -> int:
    """A deterministic 'model': the next token from the request's tokens so far."""
    return 3 + (hash((request.request_id, request.num_tokens)) % 1000)


def run(scheduler, waves: list[list[tuple[str, list[int], int]]]) -> dict:
    """scheduler_steps.run_waves with two steps in flight; the tree's blocks checked against
    the requests' tokens after every step."""
    tree = getattr(scheduler, "tree", None)
    check = None if tree is None else (lambda requests: check_tree_holds_request_tokens(
        tree, requests))
    return run_waves(scheduler, waves, BS, sampled, async_scheduling=True, after_update=check)


def check_tree_holds_request_tokens(tree, requests) -> None:
    """Every live sequence's slots: the request's known tokens, then only pending ones."""
    for rid, seq in tree.seqs.items():
        held = [t for c in seq.chunks for t in c.token_ids] + seq.tail_token_ids
        known = len(held) - seq.num_pending
        assert held[:known] == requests[rid].all_token_ids[:known], rid
        assert held[known:] == [PENDING] * seq.num_pending


def test_async_scheduling_with_the_tree_matches_stock(monkeypatch):
    system = [3 + (7 + k) % 900 for k in range(3 * BS + 5)]
    first = [(f"a{i}", system + [3 + (i * 31 + k) % 900 for k in range(9 + i)], 20 + 3 * i)
             for i in range(6)]
    results = {}
    for name, cls in (("stock", AsyncScheduler), ("tree", ChunkAttnAsyncScheduler)):
        scheduler = make_scheduler(cls, monkeypatch)
        r1 = run(scheduler, [first])
        # Second turn: each prompt + its output + a new question; its prefix includes tokens
        # that were pending when their slots were allocated.
        second = [(f"b{i}", prompt + r1["outputs"][rid] + [5, 6, 7], 8)
                  for i, (rid, prompt, _) in enumerate(first)]
        r2 = run(scheduler, [second])
        results[name] = (r1, r2)
        if name == "tree":
            assert scheduler.tree_metrics.invariant_checks > 0
            assert scheduler.tree.stats().num_in_use_blocks == 0
    (s1, s2), (t1, t2) = results["stock"], results["tree"]
    assert t1["steps"] == s1["steps"] and t2["steps"] == s2["steps"]
    assert t1["outputs"] == s1["outputs"] and t2["outputs"] == s2["outputs"]
    assert t1["usage"] == s1["usage"] and t2["usage"] == s2["usage"]
    assert t2["hits"] == s2["hits"]
    # The second turn's hits reach into the first turn's decoded (once pending) tokens.
    assert all(t2["hits"][f"b{i}"] > len(first[i][1]) for i in range(len(first))), t2["hits"]


def test_one_prefix_waves_are_scheduled_as_stock_with_prefix_aware_admission(monkeypatch):
    """The H100 pair's workload in small (prefix1x2k_c256: a wave of requests sharing one prompt
    prefix at once, a second wave as the first ends): CUSTOM's scheduler as served (async,
    prefix-aware admission on) schedules the same tokens every step as stock's, with the same
    hits: the prefix computed once, in the first step, by the first request. Its longer TTFT in
    that pair is not the scheduler's decisions (bench/serve_waves.py). The KV cache usage vLLM
    reports is stock's at every step (a finished wave's cached chunks count as free, as stock's
    cached blocks): the pairs' peak KV differences (+0.08 % H100, +2.1 % H200) come from when
    requests reached each engine, not from what the tree holds for the same schedule."""
    prefix = [3 + (11 * k) % 800 for k in range(4 * BS)]

    def wave(tag: str, seed: int) -> list[tuple[str, list[int], int]]:
        return [(f"{tag}{i}", prefix + [3 + (seed * 97 + i * 31 + k) % 900 for k in range(10)], 6)
                for i in range(12)]
    results = {name: run(make_scheduler(cls, monkeypatch, prefix_aware=True),
                         [wave("a", 1), wave("b", 2)])
               for name, cls in (("stock", AsyncScheduler), ("tree", ChunkAttnAsyncScheduler))}
    stock, tree = results["stock"], results["tree"]
    assert tree["steps"] == stock["steps"] and tree["outputs"] == stock["outputs"]
    assert tree["usage"] == stock["usage"]
    assert max(stock["usage"]) > 0.3 and stock["usage"][-1] == 0.0    # a full wave, then none
    assert tree["hits"] == stock["hits"]
    assert sorted(tree["hits"].values()) == [0] + [4 * BS] * 23
    assert len(tree["steps"][0]) == 12          # the whole first wave admitted in one step


def test_prefix_aware_admission_orders_by_tree_match_from_the_last_steps_matches(monkeypatch):
    """Waiting requests go longest tree match first, then those sharing a first chunk together;
    each step extends a request's match of the step before (tree.match_prefix's `previous`),
    which stays what a match from the root gives as the tree's chunks are released and evicted."""
    sched = make_scheduler(ChunkAttnAsyncScheduler, monkeypatch, prefix_aware=True)
    sys_a, sys_b = [3 + k for k in range(3 * BS)], [500 + k for k in range(BS)]
    running = Request("run", sys_a + [7] * 5, SamplingParams(max_tokens=4), None)
    sched.add_request(running)
    sched.schedule()                                    # admitted: sys_a's 3 chunks listed
    prompts = {"w0": sys_b + [9] * 4, "w1": sys_a[:BS] + [8] * 4, "w2": sys_a + [6] * 4,
               "w4": [900 + k for k in range(BS + 2)], "w3": sys_b + [10] * 4}
    for rid, prompt in prompts.items():                 # arrival order: w0 w1 w2 w4 w3
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=4), None))

    def order_and_check() -> list[str]:
        sched._order_waiting()
        for r in sched.waiting:
            assert sched._matches[r.request_id] == sched.tree.match_prefix(
                r.all_token_ids, request_namespace(r), r.num_tokens - 1), r.request_id
        return [r.request_id for r in sched.waiting]

    # 3 chunks matched, 1, then no match: w0 with w3 (first chunk sys_b), then w4
    assert order_and_check() == ["w2", "w1", "w0", "w3", "w4"]
    assert [len(sched._matches[r]) for r in ("w2", "w1", "w0")] == [3, 1, 0]
    assert order_and_check() == ["w2", "w1", "w0", "w3", "w4"]       # from the kept matches
    sched.finish_requests("run", RequestStatus.FINISHED_ABORTED)    # sys_a's chunks: cached
    assert order_and_check() == ["w2", "w1", "w0", "w3", "w4"]
    sched.tree.evict(1)                                 # the leaf: sys_a's third chunk
    assert order_and_check() == ["w2", "w1", "w0", "w3", "w4"]
    assert [len(sched._matches[r]) for r in ("w2", "w1")] == [2, 1]
    sched.tree.evict(2)                                 # nothing of sys_a is left
    assert order_and_check() == ["w2", "w1", "w0", "w3", "w4"]       # ties keep their order
    assert all(not m for m in sched._matches.values())
