"""KV cache events from the chunk prefix tree, in-process: vLLM's Scheduler (sync and async) with
stock's KVCacheManager and with the tree side by side, KV events on, the same deterministic
'model'. Without eviction every step publishes the same events as stock; under eviction a consumer replaying the tree's
events holds exactly the tree's matchable chunks, under the hashes vLLM's own hash function gives
their token paths, and never sees a block whose parent it was not told about."""
from collections import deque

import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import CacheConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, hash_block_tokens,
                                         init_none_hash, maybe_convert_block_hash)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from vllm_chunkattn.plugin.scheduler import ChunkAttnAsyncScheduler, ChunkAttnScheduler
from scheduler_steps import sampled_output
from vllm_runs import tiny_model

pytestmark = pytest.mark.vllm
BS = 16
PAIRS = {"sync": (Scheduler, ChunkAttnScheduler),
         "async": (AsyncScheduler, ChunkAttnAsyncScheduler)}


class Recorder:
    """Stands in for vLLM's ZMQ publisher: keeps each step's batch of events."""

    def __init__(self):
        self.batches = []

    def publish(self, batch) -> None:
        self.batches.append(list(batch.events))

    def shutdown(self) -> None:
        pass


def make_scheduler(cls, monkeypatch, num_blocks: int, is_async: bool):
    monkeypatch.setenv("CHUNKATTN_PREFIX_AWARE_SCHEDULING", "0")     # stock's admission order
    monkeypatch.setenv("CHUNKATTN_DEBUG_TREE", "1")                  # invariants every step
    config = VllmConfig(model_config=ModelConfig(model=str(tiny_model()), dtype="float32"),
                        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
                        scheduler_config=SchedulerConfig(max_num_batched_tokens=256,
                                                         max_num_seqs=16, max_model_len=1024,
                                                         is_encoder_decoder=False),
                        kv_events_config=KVEventsConfig(enable_kv_cache_events=True,
                                                        publisher="null"))
    config.scheduler_config.async_scheduling = is_async
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    scheduler = cls(config, kv, StructuredOutputManager(config), block_size=BS)
    scheduler.kv_event_publisher = Recorder()
    return scheduler


def sampled(request: Request) -> int:
    """A deterministic 'model': the next token from the request's last tokens, so requests
    with the same tokens decode the same continuation (and fill the same blocks)."""
    return 3 + hash(tuple(request.all_token_ids[-4:])) % 900


def run(scheduler, waves, abort_after: dict | None = None, on_step=None) -> dict:
    """Batch-queue loop (two steps in flight when async); each wave arrives when the previous
    one has finished. `abort_after`: request id -> step after which it is aborted."""
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BS, hash_fn)
    requests, depth, step = {}, 1 + isinstance(scheduler, AsyncScheduler), 0

    for wave in waves:
        for rid, prompt, max_tokens, extra in wave:
            requests[rid] = Request(rid, prompt, SamplingParams(max_tokens=max_tokens,
                                                                ignore_eos=True, extra_args=extra),
                                    None, block_hasher=hasher)
            scheduler.add_request(requests[rid])
        in_flight = deque(scheduler.schedule() for _ in range(depth))
        while in_flight:
            out = in_flight.popleft()
            scheduler.update_from_output(out, sampled_output(out, requests, sampled))
            step += 1
            for rid, at in (abort_after or {}).items():
                if at == step:
                    scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            if on_step is not None:
                on_step(scheduler)
            nxt = scheduler.schedule()
            if nxt.num_scheduled_tokens:
                in_flight.append(nxt)
        assert scheduler.get_num_unfinished_requests() == 0
    return {rid: list(r.output_token_ids) for rid, r in requests.items()}


def waves_with_shared_prefixes():
    system = [3 + (7 * k) % 900 for k in range(3 * BS + 5)]
    other = [5 + (13 * k) % 900 for k in range(2 * BS)]
    full = {"kv_cache_report_mode": "full"}          # hits re-announced, as stock does
    first = [(f"a{i}", system + [3 + (i * 31 + k) % 900 for k in range(9 + 4 * i)], 20 + 3 * i,
              None) for i in range(5)]
    first += [("o0", other + [8] * 3, 12, None), ("o1", other + [9] * 20, 9, full)]
    second = [(f"b{i}", system + [11 + i] * (BS + 2), 6, full if i % 2 else None)
              for i in range(4)]
    return first, second


@pytest.mark.parametrize("mode", sorted(PAIRS))
def test_every_step_publishes_stocks_events(mode, monkeypatch):
    """No eviction (a large pool), no two requests filling the same block: shared prefixes, hits re-announced in "full" report mode,
    a second wave reusing cached chunks, a follow-up turn reaching into decoded tokens, an
    abort mid-decode, then a reset."""
    first, second = waves_with_shared_prefixes()
    results = {}
    for name, cls in zip(("stock", "tree"), PAIRS[mode]):
        scheduler = make_scheduler(cls, monkeypatch, num_blocks=200, is_async=mode == "async")
        outputs = run(scheduler, [first, second], abort_after={"a3": 9})
        turn = [(f"c{i}", first[i][1] + outputs[f"a{i}"] + [7, 7], 4, None) for i in range(3)]
        run(scheduler, [turn])
        assert scheduler.reset_prefix_cache()
        idle = scheduler.schedule()                  # its output publishes the clear
        scheduler.update_from_output(idle, sampled_output(idle, {}, sampled))
        results[name] = (outputs, scheduler.kv_event_publisher.batches)
    (stock_out, stock_events), (tree_out, tree_events) = results["stock"], results["tree"]
    assert tree_out == stock_out
    assert tree_events == stock_events
    events = [e for batch in tree_events for e in batch]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) > 10 and any(e.parent_block_hash is not None for e in stored)
    assert any(e.parent_block_hash is None and len(e.block_hashes) >= 3 for e in stored[3:]), \
        "no hit re-announced"
    assert isinstance(events[-1], AllBlocksCleared)
    assert all(e.kv_cache_spec_kind == "full_attention" and e.group_idx == 0 for e in stored)


def chunk_hashes(tree) -> set:
    """The hash vLLM's own function gives each matchable chunk's token path (no extra keys)."""
    hash_fn = get_hash_fn_by_name("sha256")
    hashes, stack = set(), [(tree.root, None)]
    while stack:
        node, parent_hash = stack.pop()
        for child in node.children.values():
            h = hash_block_tokens(hash_fn, parent_hash, child.token_ids)
            hashes.add(maybe_convert_block_hash(h))
            stack.append((child, h))
    return hashes


class Consumer:
    """What an indexer keeps from the events, with the checks llm-d's makes."""

    def __init__(self):
        self.held: set = set()
        self.seen = 0

    def replay(self, batches) -> None:
        for batch in batches[self.seen:]:
            for event in batch:
                if isinstance(event, BlockStored):
                    assert event.parent_block_hash is None or event.parent_block_hash in \
                        self.held, "a block whose parent was never announced"
                    assert self.held.isdisjoint(event.block_hashes), "announced twice"
                    self.held.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    assert set(event.block_hashes) <= self.held, "removed, never stored"
                    self.held.difference_update(event.block_hashes)
                else:
                    self.held.clear()
        self.seen = len(batches)


@pytest.mark.parametrize("mode", sorted(PAIRS))
def test_under_eviction_the_events_describe_the_tree(mode, monkeypatch):
    """A pool of 40 blocks for waves that need more: after every step a consumer of the events
    holds exactly the hashes of the tree's matchable chunks. Two requests with one prompt
    decode the same tokens, so one of them fills duplicate blocks (never announced)."""
    system = [3 + (7 * k) % 900 for k in range(2 * BS)]
    waves = [[(f"w{w}r{i}", system[:BS * (1 + (i + w) % 2)] + [100 * w + i] * (BS + 3 * i),
               24, None) for i in range(5)] for w in range(4)]
    waves[1] += [("twin0", [41] * (BS + 1), 2 * BS, None), ("twin1", [41] * (BS + 1), 2 * BS, None)]
    scheduler = make_scheduler(PAIRS[mode][1], monkeypatch, num_blocks=40,
                               is_async=mode == "async")
    consumer = Consumer()
    checks, duplicates = [], set()

    def check(sched) -> None:
        consumer.replay(sched.kv_event_publisher.batches)
        assert consumer.held == chunk_hashes(sched.tree)
        checks.append(len(consumer.held))
        duplicates.update(c for seq in sched.tree.seqs.values() for c in seq.chunks
                          if not c.listed)

    run(scheduler, waves, on_step=check)
    removed = sum(isinstance(e, BlockRemoved) for b in scheduler.kv_event_publisher.batches
                  for e in b)
    assert scheduler.tree.num_evictions > 0 and removed == scheduler.tree.num_evictions
    assert len(checks) > 20 and max(checks) > 10
    assert duplicates, "the twins filled no duplicate block"
