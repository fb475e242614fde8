"""vLLM's KVCacheManager with the chunk prefix tree as its source of truth (CUSTOM backend only).

Prefix matching, caching and eviction go through `ChunkPrefixTree`; vLLM's block-hash map and
free queue are never consulted on this path. Every method vLLM's scheduler calls is defined here
(tests/plugin/test_kv_cache_manager.py checks the installed vLLM): a tree answer, an explicit delegation
to the wrapped stock manager where vLLM's state is still the truth (hit statistics), or a clear
refusal; a KVCacheManager method vLLM calls that is missing here is an AttributeError naming
it, never stock code running on state the tree does not fill. The stock manager's
`BlockPool.blocks` serve as the `KVCacheBlock` id carriers `KVCacheBlocks` expects.

Why a whole-manager swap (installed by `ChunkAttnScheduler`, see scheduler.py) rather than a
custom KVCacheSpec + SingleTypeKVCacheManager via `customize_spec`: a single-type manager sees
block hashes, not tokens, allocates from vLLM's shared BlockPool and is evicted by the pool's
free queue, so the tree could only mirror vLLM's decisions, never make them. At the manager
level `allocate_slots` gets the `Request` (tokens, LoRA, cache_salt), and the scheduler seam is
needed anyway for prefix-aware admission.

Token ids are needed to grow the tree, so tokens are added when their slots are allocated:
on admission the first scheduled chunk (`add_sequence`), then each later chunk or decode token
(`append`). Like vLLM, full blocks become matchable when scheduled (their KV is written in that
same step before any reader in the step attends to it). Async scheduling allocates a decode
slot before the token that goes in it is sampled: the tree holds it as pending (never matchable)
and writes the id when vLLM's `cache_blocks` reports the step's output, or at the next
allocation, whichever comes first. Speculative decoding's draft tokens are held the same way:
pending until vLLM accepts them (see `_resolve`).

Hybrid models (full and sliding-window layers in separate KV cache groups, vLLM's default for
gpt-oss and Gemma 2/3): the tree's chunks are the full-attention group's blocks and
`WindowGroups` keeps the window groups' blocks in lockstep, freeing those out of every window
(window_groups.py). Each KVCacheBlocks answer then has one list per group, in vLLM's group order.
"""
from __future__ import annotations

from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.request import Request, RequestStatus

from ..tree import ChunkPrefixTree, _num_blocks_for
from ..window_groups import WindowGroups
from .kv_events import TreeKVEvents
from .namespace import request_namespace


class ChunkTreeKVCacheManager:
    """Wraps the scheduler's stock manager (composition: the stock one keeps vLLM's config and
    hit statistics; its `BlockPool.blocks` carry block ids); the tree owns every block id but
    the null block. Anything vLLM asks for beyond what is listed here is a clear error."""

    # What vLLM's Scheduler and EngineCore read as attributes, taken from the stock manager at
    # construction: configuration, and the coordinator / pool whose *shape* vLLM reads (groups,
    # block sizes) while the tree, not their free lists, decides what is allocated.
    STOCK_ATTRIBUTES = ("kv_cache_config", "max_model_len", "enable_caching", "log_stats",
                        "watermark_blocks", "empty_kv_cache_blocks", "num_kv_cache_groups",
                        "coordinator", "block_pool", "mamba_shared_prefix_checkpoint",
                        "use_eagle", "enable_kv_cache_events")

    def __init__(self, stock: KVCacheManager, block_size: int):
        self.stock = stock
        for name in self.STOCK_ATTRIBUTES:
            setattr(self, name, getattr(stock, name))
        self.block_size = block_size
        self.tree = ChunkPrefixTree(self.kv_cache_config.num_blocks, block_size)
        self._blocks = self.block_pool.blocks      # block id -> KVCacheBlock (id carrier only)
        self.window: WindowGroups | None = None
        self._window_cap: int | None = None        # a window group's admission cap, in blocks
        groups = [g.kv_cache_spec for g in self.kv_cache_config.kv_cache_groups]
        self.full_group, window_group_ids = 0, []
        if len(groups) > 1:                        # one full group, the rest windowed (support.py)
            window_group_ids = [i for i, spec in enumerate(groups)
                                if getattr(spec, "sliding_window", None)]
            self.full_group = next(i for i in range(len(groups)) if i not in window_group_ids)
            self.window = WindowGroups(self.tree, len(window_group_ids),
                                       groups[window_group_ids[0]].sliding_window)
            manager = self.coordinator.single_type_managers[window_group_ids[0]]
            self._window_cap = getattr(manager, "max_admission_blocks_per_request", None)
        self._window_group_ids = window_group_ids
        self.kv_events = None
        if self.enable_kv_cache_events and self.enable_caching and self.window is not None:
            # The plugin gives models with windowed layers one KV cache group when events are on.
            raise NotImplementedError("KV cache events with hybrid KV cache groups: the chunk "
                                      "tree publishes the full-attention group's only")
        if self.enable_kv_cache_events and self.enable_caching:
            self.kv_events = TreeKVEvents(self.tree, self.block_pool, block_size)
            self.kv_events.install(self)

    def __getattr__(self, name: str):
        # Only reached for names this class does not define. An AttributeError still (so that
        # hasattr() works), but one that says what is going on when vLLM grew a new call.
        stock = self.__dict__.get("stock")
        if hasattr(KVCacheManager, name) or (stock is not None and name in stock.__dict__):
            raise AttributeError(
                f"vLLM asked the KV cache manager for {name!r}, which the chunk prefix tree "
                f"manager (--attention-backend CUSTOM) does not provide: this vLLM is newer "
                f"than the plugin supports, or the feature is refused at start-up", name=name,
                obj=self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}",
                             name=name, obj=self)

    @property
    def prefix_cache_stats(self):
        return self.stock.prefix_cache_stats     # vLLM's hit counters: the stock manager's

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.stock.prefix_cache_lookup_enabled(request)

    # -- queries -------------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        tree = self.tree
        num_free = len(tree.free_block_ids) + tree.num_reclaimable_blocks  # as vLLM: cached is free
        return 1.0 - num_free / tree.pool_size

    def get_computed_blocks(self, request: Request, max_cache_hit_length: int | None = None
                            ) -> tuple[KVCacheBlocks, int, int]:
        """vLLM 0.33 passes max_cache_hit_length (tokens) positionally; 0.32 does not."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        # The last token is always recomputed, to get its logits.
        max_tokens = request.num_tokens - 1
        if max_cache_hit_length is not None:
            max_tokens = min(max_tokens, max_cache_hit_length)
        matched = self.tree.match_prefix(request.all_token_ids, request_namespace(request),
                                         max_tokens)
        if self.use_eagle:
            # As vLLM: a drafter with KV of its own (EAGLE, MTP) needs the hidden states of the
            # tokens before the generation point, so the last matched block is recomputed.
            matched = matched[:-1]
        if self.window is not None:
            matched = matched[:self.window.hit_length(matched)]
        if not matched:
            return self.empty_kv_cache_blocks, 0, 0
        if self.kv_events is not None:
            self.kv_events.announce_hit(request, matched)
        window_rows = self.window.hit_block_ids(matched) if self.window is not None else ()
        return (self._kv_blocks([c.block_id for c in matched], window_rows),
                len(matched) * self.block_size, 0)

    def _kv_blocks(self, full_ids: list[int], window_rows=()) -> KVCacheBlocks:
        """KVCacheBlocks of these block ids (_block_id_rows)."""
        blocks = self._blocks
        return KVCacheBlocks(tuple([blocks[b] for b in row]
                                   for row in self._block_id_rows(full_ids, window_rows)))

    def _block_id_rows(self, full_ids: list[int], window_rows=()) -> tuple[list[int], ...]:
        """One row per KV cache group in vLLM's order: the full group's, each window group's."""
        if self.window is None:
            return (full_ids,)
        rows = [None] * (1 + len(self._window_group_ids))
        rows[self.full_group] = full_ids
        for g, row in zip(self._window_group_ids, window_rows):
            rows[g] = row
        return tuple(rows)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        if request_id not in self.tree.seqs:
            return self.empty_kv_cache_blocks
        return self._kv_blocks(self.tree.block_ids(request_id), self._window_rows(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        if request_id not in self.tree.seqs:
            return self._block_id_rows([], [[]] * len(self._window_group_ids))
        return self._block_id_rows(self.tree.block_ids(request_id),
                                   self._window_rows(request_id))

    def _window_rows(self, request_id: str):
        return self.window.block_ids(request_id) if self.window is not None else ()

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int
                                          ) -> tuple[list[int], ...]:
        num_blocks = _num_blocks_for(num_computed_tokens, self.block_size)
        return tuple(row[:num_blocks] for row in self.get_block_ids(request_id))

    def get_computed_blocks_for_connector(self, request: Request,
                                          max_cache_hit_length: int | None = None
                                          ) -> tuple[KVCacheBlocks, int, int, bool]:
        # vLLM's answer for models without Mamba groups: the plain lookup, never diverged.
        # vLLM 0.33 passes max_cache_hit_length positionally, as to get_computed_blocks.
        return *self.get_computed_blocks(request, max_cache_hit_length), False

    def truncate_computed_blocks(self, blocks: KVCacheBlocks,
                                 num_computed_tokens: int) -> KVCacheBlocks:
        assert num_computed_tokens % self.block_size == 0, num_computed_tokens
        num_blocks = num_computed_tokens // self.block_size
        if not num_blocks:
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(tuple(list(group[:num_blocks]) for group in blocks.blocks))

    def estimate_cached_tokens(self, request: Request) -> int:
        seq = self.tree.seqs.get(request.request_id)
        return len(seq.chunks) * self.block_size if seq is not None else 0

    # -- allocation ----------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = ()) -> KVCacheBlocks | None:
        if num_external_computed_tokens or num_encoder_tokens:
            raise NotImplementedError("the chunk prefix tree needs token ids: no KV "
                                      "connectors or encoder-decoder models")
        tree, rid = self.tree, request.request_id
        # Scheduled tokens include unverified draft tokens (request.num_tokens does not):
        # their slots, and a drafter's lookahead slots, are pending in the tree.
        target = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        target = max(target, min(target + num_lookahead_tokens, self.max_model_len))
        if rid not in tree.seqs:
            return self._admit(request, target, num_new_computed_tokens, full_sequence_must_fit,
                               reserved_blocks, has_scheduled_reqs)
        self._resolve(request)
        window = self.window
        if window is not None:
            # As vLLM's allocate_slots: on the processed-token basis (in-flight steps' windows
            # still read below the optimistic boundary), before allocating.
            window.release_skipped(rid, max(0, request.num_computed_tokens
                                            + num_new_computed_tokens
                                            - getattr(request, "num_in_flight_tokens", 0)))
        have = tree.num_tokens(rid)
        if target <= have:
            # Slots of rejected draft tokens stay allocated (pending), as vLLM keeps their
            # blocks: this step's tokens go into them.
            return self.empty_kv_cache_blocks
        num_new = _num_blocks_for(target, self.block_size) - len(tree.block_ids(rid))
        if window is not None:
            num_new += window.num_new_blocks(num_new)
        if (reserved_blocks or window is not None) and not tree.can_allocate(num_new
                                                                            + reserved_blocks):
            return None
        known = request.num_tokens              # beyond it: slots for tokens not sampled yet
        new_block_ids = tree.append(rid, request.all_token_ids[have:min(target, known)],
                                    num_pending=max(0, target - max(have, known)))
        if new_block_ids is None:
            return None
        # A tail the tokens just filled is a chunk now, even with no new block.
        window_rows = window.sync(rid) if window is not None else ()
        if not new_block_ids:
            return self.empty_kv_cache_blocks
        return self._kv_blocks(new_block_ids, window_rows)

    def _admit(self, request: Request, target: int, num_hit_tokens: int,
               full_sequence_must_fit: bool, reserved_blocks: int,
               has_scheduled_reqs: bool) -> KVCacheBlocks | None:
        tree, rid, bs = self.tree, request.request_id, self.block_size
        namespace = request_namespace(request)
        token_ids = request.all_token_ids
        matched = tree.match_prefix(token_ids, namespace, num_hit_tokens) if num_hit_tokens else []
        window = self.window
        if window is not None:
            matched = matched[:window.hit_length(matched)]
        if len(matched) * bs != num_hit_tokens:
            return None     # the hit get_computed_blocks reported is gone: retry next step
        watermark = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING,
                                                    RequestStatus.PREEMPTED):
            watermark = self.watermark_blocks
        # As vLLM's allocate_slots: the whole sequence must fit the free blocks (watermark
        # kept), and reserved_blocks gates only the chunk scheduled now.
        if full_sequence_must_fit:
            num_tokens = min(request.num_tokens, self.max_model_len)
            num_blocks = _num_blocks_for(num_tokens, bs)
            num_new = num_blocks - len(matched)
            if window is not None:      # as vLLM: a window's blocks up to its admission cap
                cap = self._window_cap
                num_window = num_blocks if cap is None else min(num_blocks, cap)
                num_new += window.num_new_blocks(max(0, num_window - len(matched)))
            if not tree.can_allocate(num_new + watermark, matched):
                return None
        num_new = _num_blocks_for(target, bs) - len(matched)
        if window is not None:
            num_new += window.num_new_blocks(num_new)
        if watermark or reserved_blocks or window is not None:
            if not tree.can_allocate(num_new + watermark + reserved_blocks, matched):
                return None
        known = min(target, request.num_tokens)     # beyond it: slots for unsampled tokens
        if window is not None:
            window.admit(rid, matched)              # held first: allocations may reclaim
        shared = tree.add_sequence(rid, token_ids[:known], namespace,
                                   max_shared_tokens=num_hit_tokens, num_pending=target - known)
        if shared is None:      # no window here: with one, can_allocate said it fits
            assert window is None
            return None
        assert shared == num_hit_tokens, (shared, num_hit_tokens)
        return self._kv_blocks(tree.block_ids(rid)[len(matched):],
                               window.sync(rid) if window is not None else ())

    def free(self, request: Request) -> None:
        if request.request_id in self.tree.seqs:
            if self.window is not None:
                self.window.release(request.request_id)
            self.tree.release(request.request_id)

    def pop_blocks_for_free(self, request: Request) -> list:
        # Deferred frees exist only for async KV connectors, which this path refuses.
        self.free(request)
        return []

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        # Chunks are cached as their tokens are allocated. vLLM's async scheduler calls this
        # when a step's sampled tokens arrive: the moment to write them into pending slots.
        if request.request_id in self.tree.seqs:
            self._resolve(request)

    def _resolve(self, request: Request) -> None:
        """Write the ids of sampled tokens into the slots the tree holds for them. A draft
        token's slot gets the id vLLM accepted there (the draft's) or sampled instead (the
        bonus token, whose KV the step being scheduled writes); slots past the request's
        tokens, of rejected drafts, stay pending: no id the tree holds is an unverified draft."""
        tree, rid = self.tree, request.request_id
        num_pending = tree.seqs[rid].num_pending
        if num_pending:
            first = tree.num_tokens(rid) - num_pending
            tree.resolve(rid, request.all_token_ids[first:first + num_pending])

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        # Full attention skips nothing; window groups let go of what fell out of the window.
        if self.window is not None and request_id in self.tree.seqs:
            self.window.release_skipped(request_id, processed_computed_tokens)

    def evict_blocks(self, block_ids: set[int]) -> None:
        # Only KV-connector load failures ask for this (connectors are refused at start-up).
        raise NotImplementedError("evict_blocks(block_ids) is not supported by the chunk tree")

    def reset_prefix_cache(self) -> bool:
        if not self.tree.reset():
            return False
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list:
        # The tree's events wait in the stock pool's queue (kv_events.py): vLLM's own drain
        # annotates them with the group's spec kind.
        return self.stock.take_events()

    # -- hit statistics: vLLM's own counters (no block state), delegated explicitly --------------

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        self.stock.record_prefix_cache_stats(request, num_hits)

    def make_prefix_cache_stats(self):
        return self.stock.make_prefix_cache_stats()

    # -- per-step drains: what vLLM's single-type managers hand the worker ----------------------
    # One full-attention group without zeroing is all the scheduler admits (scheduler.py), so
    # these have nothing to report; the stock coordinator never sees an allocation to drain.

    def new_step_starts(self) -> None:
        pass                                # per-step state exists for sliding window / Mamba only

    def take_new_block_ids(self) -> list[int]:
        return []                           # no block needs zeroing

    def take_kv_cache_block_copies(self) -> tuple[list, list]:
        return [], []                       # no copy-on-write: tails are private, chunks shared

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}                           # Mamba "align" states only

    # -- KV connectors only (refused at start-up) ------------------------------------------------

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        raise NotImplementedError("KV connectors are not supported by the chunk tree "
                                  "(finalize_partial_tail_offloads)")

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        raise NotImplementedError("KV connectors are not supported by the chunk tree "
                                  "(record_blocks_for_zeroing after a failed KV load)")
