"""Speculative decoding's draft slots in the chunk prefix tree, side by side with stock vLLM's
Scheduler and KVCacheManager on the same drafts and the same verdicts (EngineCore's sync loop:
schedule, the step's sampled tokens, then the next drafts). A fake model knows each position's
true token; its drafter proposes some true and some wrong tokens, so every verify step accepts
a prefix of its drafts and rejects the rest. Checked every step: the same tokens scheduled, the
same number of blocks per request and KV usage as stock, the tree's invariants, its sequences
holding the request's tokens then only pending slots, and no listed chunk spelling anything but
a prefix of a request's final tokens (no rejected draft is ever matchable). Also under
preemption in a small pool, an abort with drafts in flight, and the spec-decode counts."""
import zlib

import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import (CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                         SpeculativeConfig, VllmConfig)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from vllm_chunkattn.plugin.scheduler import ChunkAttnScheduler
from vllm_chunkattn.tree import PENDING
from vllm_runs import tiny_model

pytestmark = pytest.mark.vllm
BS, NUM_SPEC = 16, 3


def make_scheduler(cls, monkeypatch, num_blocks: int):
    monkeypatch.setenv("CHUNKATTN_PREFIX_AWARE_SCHEDULING", "0")   # FCFS in both: one order
    monkeypatch.setenv("CHUNKATTN_DEBUG_TREE", "1")                # invariants every step
    model = ModelConfig(model=str(tiny_model()), dtype="float32")
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=NUM_SPEC,
                             prompt_lookup_max=3, prompt_lookup_min=2,
                             target_model_config=model, target_parallel_config=ParallelConfig())
    config = VllmConfig(model_config=model,
                        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
                        scheduler_config=SchedulerConfig(max_num_batched_tokens=256,
                                                         max_num_seqs=16, max_model_len=1024,
                                                         is_encoder_decoder=False),
                        speculative_config=spec)
    assert not config.scheduler_config.async_scheduling
    config.cache_config.num_gpu_blocks = num_blocks
    kv_spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64,
                                dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer.0"], kv_spec)])
    return cls(config, kv, StructuredOutputManager(config), block_size=BS, log_stats=True)


def true_token(request_id: str, position: int) -> int:
    """The fake model's token at `position` of a request's output stream."""
    return 3 + zlib.crc32(f"{request_id}:{position}".encode()) % 1000


def draft(request: Request) -> list[int]:
    """NUM_SPEC drafts after the request's tokens: true ones, except where a position's coin
    says wrong (about one in three), so verdicts mix acceptances and rejections."""
    start = request.num_tokens
    return [true_token(request.request_id, p) + (1 if zlib.crc32(f"{p}".encode()) % 3 == 0
                                                 else 0)
            for p in range(start, start + NUM_SPEC)]


def verify(request: Request, num_scheduled: int, drafts: list[int]) -> list[int]:
    """Sampled tokens of a step: the accepted drafts, then the model's own token; none while
    the prompt is still being prefilled."""
    end = request.num_computed_tokens + num_scheduled      # num_computed is this step's start
    if end - len(drafts) < request.num_tokens:
        return []
    out, position = [], request.num_tokens
    for d in drafts:
        if d != true_token(request.request_id, position):
            break
        out.append(d)
        position += 1
    return out + [true_token(request.request_id, position)]


def run(scheduler, prompts: dict[str, list[int]], max_tokens: int,
        abort_after: tuple[str, int] | None = None) -> dict:
    """The sync loop until every request finished. abort_after = (request, step): abort it
    right after that step's output, with the drafts proposed for its next step."""
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BS, hash_fn)
    requests = {rid: Request(rid, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                             None, block_hasher=hasher) for rid, p in prompts.items()}
    for r in requests.values():
        scheduler.add_request(r)
    tree = getattr(scheduler, "tree", None)
    steps, blocks, usage, drafted, accepted = [], [], [], 0, 0
    while scheduler.get_num_unfinished_requests():
        out = scheduler.schedule()
        steps.append(dict(out.num_scheduled_tokens))
        usage.append(scheduler.kv_cache_manager.usage)
        blocks.append({rid: len(scheduler.kv_cache_manager.get_block_ids(rid)[0])
                       for rid in out.num_scheduled_tokens})
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            tokens = verify(requests[rid], out.num_scheduled_tokens[rid], drafts)
            if drafts:
                drafted += len(drafts)
                accepted += len(tokens) - 1
            sampled.append(tokens)
        scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
            pooler_output=[]))
        live = [rid for rid in ids if not requests[rid].is_finished()]
        scheduler.update_draft_token_ids(DraftTokenIds(live, [draft(requests[r]) for r in live]))
        if abort_after and len(steps) == abort_after[1]:
            scheduler.finish_requests(abort_after[0], RequestStatus.FINISHED_ABORTED)
        if tree is not None:
            check_tree_holds_only_request_tokens(tree, requests)
    return {"steps": steps, "blocks": blocks, "usage": usage, "drafted": drafted,
            "accepted": accepted,
            "outputs": {rid: list(r.output_token_ids) for rid, r in requests.items()}}


def check_tree_holds_only_request_tokens(tree, requests) -> None:
    """Live sequences: the request's tokens, then pending slots only. Listed chunks (matchable,
    live or cached): each path from the root spells a prefix of some request's tokens."""
    for rid, seq in tree.seqs.items():
        held = [t for c in seq.chunks for t in c.token_ids] + seq.tail_token_ids
        known = len(held) - seq.num_pending
        assert held[:known] == requests[rid].all_token_ids[:known], rid
        assert held[known:] == [PENDING] * seq.num_pending, rid
        assert known <= requests[rid].num_tokens, rid
    finals = [tuple(r.all_token_ids) for r in requests.values()]
    stack = [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            spelled = path + child.token_ids
            assert any(f[:len(spelled)] == spelled for f in finals), "a listed chunk spells " \
                "tokens no request has: a rejected draft became matchable"
            stack.append((child, spelled))


def repeating_prompts() -> dict[str, list[int]]:
    system = [3 + (7 * k) % 900 for k in range(2 * BS + 5)]       # shared by a0..a3
    return {f"a{i}": system + [3 + (i * 31 + k) % 900 for k in range(9 + 4 * i)]
            for i in range(4)}


def both(monkeypatch, num_blocks: int, max_tokens: int, **kwargs) -> tuple[dict, dict, object]:
    stock = run(make_scheduler(Scheduler, monkeypatch, num_blocks), repeating_prompts(),
                max_tokens, **kwargs)
    tree_sched = make_scheduler(ChunkAttnScheduler, monkeypatch, num_blocks)
    tree = run(tree_sched, repeating_prompts(), max_tokens, **kwargs)
    return stock, tree, tree_sched


def assert_same_as_stock(stock: dict, tree: dict) -> None:
    assert tree["steps"] == stock["steps"]
    assert tree["blocks"] == stock["blocks"]
    assert tree["usage"] == stock["usage"]
    assert tree["outputs"] == stock["outputs"]
    assert (tree["drafted"], tree["accepted"]) == (stock["drafted"], stock["accepted"])
    assert 0 < stock["accepted"] < stock["drafted"]        # some accepted, some rejected


def test_draft_slots_are_allocated_resolved_and_freed_as_stock(monkeypatch):
    stock, tree, sched = both(monkeypatch, num_blocks=64, max_tokens=40)
    assert_same_as_stock(stock, tree)
    assert any(len(s) and max(s.values()) == 1 + NUM_SPEC for s in stock["steps"])
    assert sched.tree_metrics.invariant_checks > 0
    assert sched.tree.stats().num_in_use_blocks == 0 and not sched.tree.seqs
    sched.tree.check_invariants()


def test_preemption_with_drafts_in_flight_matches_stock(monkeypatch):
    """Four requests growing to ~90 tokens each in 16 blocks of 16 tokens: some are preempted
    (their pending draft slots released with them) and recomputed."""
    stock, tree, sched = both(monkeypatch, num_blocks=17, max_tokens=45)
    assert_same_as_stock(stock, tree)
    assert sched.tree_metrics.preemptions > 0
    assert sched.tree.stats().num_in_use_blocks == 0 and not sched.tree.seqs
    sched.tree.check_invariants()


def test_abort_with_drafts_in_flight_leaks_nothing(monkeypatch):
    stock, tree, sched = both(monkeypatch, num_blocks=64, max_tokens=40, abort_after=("a1", 6))
    assert_same_as_stock(stock, tree)
    assert len(tree["outputs"]["a1"]) < 40
    assert sched.tree.stats().num_in_use_blocks == 0 and not sched.tree.seqs
    sched.tree.check_invariants()
