"""The tree's cache changes as vLLM's own KV cache events, so routers and indexers built for stock
vLLM (vllm-router's kv_aware policy, llm-d's precise prefix-cache scorer, Dynamo's KV router)
read a CUSTOM engine unchanged.

A chunk that becomes matchable is announced with `BlockStored`, under the hash stock gives the
same block: the request's own `block_hashes` (vLLM computes them for every request when prefix
caching is on), its parent first; an evicted chunk with `BlockRemoved`; a reset with
`AllBlocksCleared`. The events go into the stock manager's event queue, so vLLM's own
`take_events` annotates and drains them and vLLM's publisher sends them.

What a consumer sees differs from stock's block pool in one way, by design: a chunk whose content
a listed sibling already holds (two requests filled the same block in the same step) is never
listed, so it is never announced or removed, nor is anything its sequence fills below it. Stock
announces every duplicate physical block under the same hash, and its children.
"""
from __future__ import annotations

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import (generate_block_hash_extra_keys,
                                         maybe_convert_block_hash, resolve_block_hashes,
                                         to_event_extra_keys)
from vllm.v1.request import Request

from ..tree import CLEARED, EVICTED, LISTED, Chunk, ChunkPrefixTree

GROUP_IDX = 0        # the tree serves one KV cache group


class TreeKVEvents:
    """Turns the tree's event log into vLLM events after each manager call that changes it."""

    def __init__(self, tree: ChunkPrefixTree, block_pool, block_size: int):
        tree.event_log = []
        self.tree = tree
        self.block_pool = block_pool        # its kv_event_queue: what vLLM's take_events drains
        self.medium = block_pool.medium
        self.hash_block_size = block_pool.hash_block_size
        self.block_size = block_size
        self.announced: dict[Chunk, object] = {}    # listed chunk -> the hash it was stored under

    def install(self, manager) -> None:
        """Publish after the manager's calls that list, evict or clear chunks. Wrapping the
        instance's methods keeps the calls free of any event check when events are off."""
        for name in ("allocate_slots", "cache_blocks"):
            setattr(manager, name, self._publishing(getattr(manager, name)))
        reset = manager.reset_prefix_cache

        def reset_prefix_cache() -> bool:
            done = reset()
            self.publish(None)
            return done
        manager.reset_prefix_cache = reset_prefix_cache

    def _publishing(self, call):
        def publishing(request: Request, *args, **kwargs):
            result = call(request, *args, **kwargs)
            self.publish(request)
            return result
        return publishing

    def publish(self, request: Request | None) -> None:
        """Every entry of the tree's log since the last call, in order; chunks listed by this
        call are `request`'s (only its own sequence fills or resolves chunks)."""
        log = self.tree.event_log
        if not log:
            return
        self.tree.event_log = []
        run: list[Chunk] = []
        for kind, chunk in log:
            if kind == LISTED and (not run or chunk.depth == run[-1].depth + 1):
                run.append(chunk)
                continue
            self._stored(request, run)
            run = []
            if kind == LISTED:
                run.append(chunk)
            elif kind == EVICTED:
                block_hash = self.announced.pop(chunk, None)
                if block_hash is not None:
                    self.block_pool.kv_event_queue.append(BlockRemoved(
                        block_hashes=[block_hash], medium=self.medium, group_idx=GROUP_IDX))
            else:
                assert kind == CLEARED, kind
                self.announced.clear()
                self.block_pool.kv_event_queue.append(AllBlocksCleared())
        self._stored(request, run)

    def announce_hit(self, request: Request, matched: list[Chunk]) -> None:
        """vLLM's "full" report mode: a request's cached prefix is re-announced on a hit."""
        if matched and getattr(request, "kv_cache_report_mode", "incremental") == "full":
            self._stored(request, matched, remember=False)

    def _stored(self, request: Request | None, run: list[Chunk], remember: bool = True) -> None:
        """One BlockStored for consecutive chunks of `request`, as stock's block pool emits one
        per newly cached run of a request's blocks."""
        if not run:
            return
        bs = self.block_size
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, bs)
        first, end = run[0].depth, min(run[-1].depth + 1, len(hashes))
        if end <= first:
            return                  # no hashes (the request is not hashed): nothing to announce
        new_hashes, extra_keys, mm_index = [], [], 0
        for index in range(first, end):
            new_hashes.append(maybe_convert_block_hash(hashes[index]))
            keys, mm_index = generate_block_hash_extra_keys(request, index * bs, (index + 1) * bs,
                                                            mm_index)
            extra_keys.append(keys)
        if remember:
            self.announced.update(zip(run, new_hashes))
        lora = request.lora_request
        self.block_pool.kv_event_queue.append(BlockStored(
            block_hashes=new_hashes,
            parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first else None,
            token_ids=request.all_token_ids[first * bs:end * bs], block_size=bs,
            lora_id=lora.adapter_id if lora else None, medium=self.medium,
            lora_name=lora.name if lora else None, extra_keys=to_event_extra_keys(extra_keys),
            group_idx=GROUP_IDX, session_id=request.session_id))
