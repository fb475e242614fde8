"""The chunk prefix tree: live sequences share the full chunks (vLLM blocks) of their common prefix,
and released chunks stay cached for later hits until evicted, leaf first, least recently released first.
Pure Python over block ids; a chunk is one vLLM block, so `block_id`s go straight into block tables.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol


SharedNode = tuple[tuple[int, ...], tuple[int, ...]]   # (block_ids, batch rows holding them)
# A slot allocated for a token not sampled yet (async scheduling allocates step N+1's slot before
# step N's token is known). Pending tokens are always a sequence's last ones; a chunk holding one
# is never listed, so nothing can match it until `resolve` writes the real ids.
PENDING = None
# What `ChunkPrefixTree.event_log` records, in order: a chunk became matchable, a cached chunk
# was evicted, every cached chunk was dropped (reset). KV event publishers read it.
LISTED, EVICTED, CLEARED = "listed", "evicted", "cleared"


def _num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class SplitNamespace:
    """A sequence namespace that changes at token `start`: chunks ending at or before it are keyed
    by `before`, the rest by `after`. Multimodal prompts: the text before the first placeholder
    is shared with requests that carry other inputs (or none), as vLLM's block hashes do."""
    before: Hashable
    after: Hashable
    start: int


def chunk_namespace(namespace: Hashable, chunk_index: int, block_size: int) -> Hashable:
    """The namespace keying chunk `chunk_index` of a sequence admitted under `namespace`."""
    if not isinstance(namespace, SplitNamespace):
        return namespace
    return namespace.before if (chunk_index + 1) * block_size <= namespace.start else namespace.after


class AuxBlocks(Protocol):
    """Blocks another KV cache group holds for the tree's chunks, from the tree's pool."""
    num_reclaimable: int                    # blocks it could free now (cached, unpinned)

    def num_pinned(self, chunks: Sequence[Chunk]) -> int:
        """Of num_reclaimable, what admitting a sequence on these matched chunks keeps."""

    def reclaim(self) -> int:
        """Free its least recently used cached blocks into the pool; how many (0: none)."""

    def on_evict(self, chunk: Chunk) -> None:
        """The chunk left the tree: free what is held for it."""

    def clear(self) -> None:
        """The pool is being reset (nothing in use): forget every block."""

    def owned_blocks(self) -> Iterable[tuple[int, object]]:
        """(block id, owner) of every block it holds, for check_invariants."""

    def check_invariants(self) -> None:
        """Assert its own books balance."""


@dataclass(slots=True)
class TreeStats:
    num_free_blocks: int        # never used, or evicted: no KV worth keeping
    num_in_use_blocks: int      # held by live sequences (shared chunks count once)
    num_cached_blocks: int      # ref_count 0 but still matchable; reclaimable by eviction
    num_hit_tokens: int         # prompt tokens served from the tree by add_sequence
    num_query_tokens: int       # prompt tokens looked up by add_sequence
    num_evictions: int
    num_shared_tokens: int      # sum over chunks of (ref_count - 1) * block_size: KV stored once, used more

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


@dataclass(slots=True, eq=False)
class Chunk:
    """One full block of `block_size` tokens. Hashes by identity, so it can key dicts and sets."""
    block_id: int
    token_ids: tuple[int, ...]
    namespace: Hashable = None  # LoRA, cache_salt, inputs: chunks of different namespaces never match
    parent: Chunk | None = None
    children: dict[tuple, Chunk] = field(default_factory=dict)  # listed children by key: O(1) lookup
    ref_count: int = 0          # live sequences whose block table holds this chunk
    last_access: int = 0        # logical time of the last release, for LRU
    listed: bool = False        # reachable from the root through `children`, i.e. matchable
    depth: int = 0              # its index in the chunk list of every sequence holding it

    @property
    def key(self) -> tuple:
        return (self.namespace, self.token_ids)


@dataclass(slots=True, eq=False)
class _SequenceBlocks:
    namespace: Hashable
    chunks: list[Chunk]                     # full chunks, root to leaf; chunks[i].parent is chunks[i-1]
    tail_block_id: int | None = None        # private partial block; None when the length is block-aligned
    tail_token_ids: list[int] = field(default_factory=list)
    num_pending: int = 0                    # trailing tokens whose ids are not known yet


class ChunkPrefixTree:
    """A prefix tree of full chunks over a fixed pool of block ids (block 0 is vLLM's null block).

    A chunk is *listed* (matchable) when it hangs under its parent's `children`. Block tables are
    append-only, so when a sequence fills a block whose content an existing sibling already holds,
    the sequence keeps its own block: that duplicate, and every chunk the sequence later fills below
    it, stays unlisted (one match entry per key, as a chained hash would give). Unlisted chunks are
    still ref-counted and shared by forks, but are freed, not cached, when their last holder goes.
    """

    def __init__(self, num_blocks: int, block_size: int, reserved: Sequence[int] = (0,)):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.reserved = frozenset(reserved)
        self.pool_size = num_blocks - len(self.reserved)
        self.seqs: dict[Hashable, _SequenceBlocks] = {}
        self.num_hit_tokens = self.num_query_tokens = self.num_evictions = self.num_shared_tokens = 0
        self.num_resolved_tokens = 0        # pending slots given their sampled ids (async scheduling)
        self._clock = 0
        self._entry_ids = itertools.count()
        # None, or a list the tree appends (LISTED | EVICTED, chunk) / (CLEARED, None) to;
        # its reader empties it.
        self.event_log: list[tuple[str, Chunk | None]] | None = None
        # None, or the blocks other KV cache groups hold for chunks (window_groups.py): they
        # draw on this pool, and what of theirs is reclaimable counts as cached here.
        self.aux: AuxBlocks | None = None
        self._clear()

    ##### Public API #####

    def match_prefix(self, token_ids: Sequence[int], namespace: Hashable = None,
                     max_tokens: int | None = None, previous: Sequence[Chunk] = ()) -> list[Chunk]:
        """Longest run of listed full chunks spelling a prefix of token_ids[:max_tokens]. No side effects.
        vLLM passes max_tokens = num_tokens - 1: the last prompt token is always recomputed.
        `previous`: an earlier result for the same tokens and namespace (the scheduler matches each
        waiting request every step, a lookup per chunk from scratch): its still-listed head under
        this root is kept, as eviction is leaf first, and only the chunks after it are looked up."""
        limit = len(token_ids) if max_tokens is None else min(len(token_ids), max_tokens)
        node, matched, bs = self.root, [], self.block_size
        if previous and previous[0].parent is self.root:        # not evicted, no reset since
            # a listed chunk's ancestors are listed: the last one tells for the whole run
            kept = (len(previous) if previous[-1].listed
                    else next(i for i, c in enumerate(previous) if not c.listed))
            matched = list(previous[:min(kept, limit // bs)])
            node = matched[-1] if matched else node
        for index in range(len(matched), limit // bs):
            start = index * bs
            key = (chunk_namespace(namespace, index, bs), tuple(token_ids[start:start + bs]))
            node = node.children.get(key)
            if node is None:
                break
            matched.append(node)
        return matched

    def can_allocate(self, num_blocks: int, pinned: Sequence[Chunk] = ()) -> bool:
        """Whether num_blocks new blocks fit once `pinned` (this request's matched chunks) are held:
        cached chunks about to be pinned cannot be evicted to make room for their own request."""
        num_reclaimable = self.num_cached_blocks - sum(1 for chunk in pinned if chunk.ref_count == 0)
        if self.aux is not None:
            num_reclaimable += self.aux.num_reclaimable - self.aux.num_pinned(pinned)
        return num_blocks <= len(self.free_block_ids) + num_reclaimable

    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int], namespace: Hashable = None,
                     max_shared_tokens: int | None = None, num_pending: int = 0) -> int | None:
        """Admit a sequence: share its longest cached prefix (at most max_shared_tokens), allocate
        blocks for the rest and for `num_pending` slots of tokens not sampled yet. Returns the
        number of shared (already computed) tokens, or None, with no effect at all, when the pool
        cannot hold it."""
        assert seq_id not in self.seqs and len(token_ids) > 0, seq_id
        matched = self.match_prefix(token_ids, namespace, max_shared_tokens)
        num_shared_tokens = len(matched) * self.block_size
        num_new_blocks = (_num_blocks_for(len(token_ids) + num_pending, self.block_size)
                          - len(matched))
        if not self.can_allocate(num_new_blocks, matched):
            return None
        for chunk in matched:               # pin before allocating: the allocation may evict
            self._pin(chunk)
        seq = self.seqs[seq_id] = _SequenceBlocks(namespace, matched, num_pending=num_pending)
        self._fill(seq, list(token_ids[num_shared_tokens:]) + [PENDING] * num_pending,
                   [self._allocate_block() for _ in range(num_new_blocks)])
        self.num_hit_tokens += num_shared_tokens
        self.num_query_tokens += len(token_ids)
        return num_shared_tokens

    def append(self, seq_id: Hashable, token_ids: Sequence[int], num_pending: int = 0
               ) -> list[int] | None:
        """Append decoded tokens, then `num_pending` slots for tokens not sampled yet. Returns the
        newly allocated block ids (one per block boundary crossed), or None, with no effect, when
        the pool cannot hold them."""
        seq = self.seqs[seq_id]
        assert not (seq.num_pending and token_ids), "known tokens after pending ones: resolve"
        num_tokens = len(token_ids) + num_pending
        num_new_blocks = (_num_blocks_for(len(seq.tail_token_ids) + num_tokens, self.block_size)
                          - (seq.tail_block_id is not None))
        if not self.can_allocate(num_new_blocks):
            return None
        new_block_ids = [self._allocate_block() for _ in range(num_new_blocks)]
        seq.num_pending += num_pending
        self._fill(seq, list(token_ids) + [PENDING] * num_pending, new_block_ids)
        return new_block_ids

    def resolve(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """The first len(token_ids) pending tokens were sampled: write their ids. Chunks that
        become fully known are listed (matchable) as if they had been filled with them."""
        seq = self.seqs[seq_id]
        assert len(token_ids) <= seq.num_pending, (len(token_ids), seq.num_pending)
        if not token_ids:
            return
        bs = self.block_size
        first = self.num_tokens(seq_id) - seq.num_pending
        seq.num_pending -= len(token_ids)
        self.num_resolved_tokens += len(token_ids)
        tail_start = len(seq.chunks) * bs
        for index in range(first // bs, len(seq.chunks)):   # sealed chunks holding pending ones
            chunk = seq.chunks[index]
            lo, hi = max(first, index * bs), min(first + len(token_ids), (index + 1) * bs)
            if lo >= hi:
                break
            ids = list(chunk.token_ids)
            ids[lo - index * bs:hi - index * bs] = token_ids[lo - first:hi - first]
            chunk.token_ids = tuple(ids)
            self._list_if_new(chunk)
        for pos in range(max(first, tail_start), first + len(token_ids)):
            seq.tail_token_ids[pos - tail_start] = token_ids[pos - first]

    def fork(self, parent_seq_id: Hashable, child_seq_id: Hashable) -> list[tuple[int, int]] | None:
        """Start child_seq_id as a copy of parent_seq_id (n > 1, beam search). Full chunks are shared;
        the partial tail is copied on write. Returns the (src, dst) block copies the caller must do,
        or None, with no effect, when no block is left for the tail."""
        parent = self.seqs[parent_seq_id]
        assert child_seq_id not in self.seqs, child_seq_id
        assert not parent.num_pending, "fork a sequence whose tokens are all known"
        has_tail = parent.tail_block_id is not None
        if has_tail and not self.can_allocate(1):
            return None
        for chunk in parent.chunks:
            self._pin(chunk)
        child = self.seqs[child_seq_id] = _SequenceBlocks(parent.namespace, list(parent.chunks))
        if not has_tail:
            return []
        child.tail_block_id = self._allocate_block()
        child.tail_token_ids = list(parent.tail_token_ids)
        return [(parent.tail_block_id, child.tail_block_id)]

    def release(self, seq_id: Hashable) -> None:
        """A sequence finished, was aborted or preempted: its listed chunks stay cached, the rest is freed."""
        seq = self.seqs.pop(seq_id)
        self._clock += 1
        if seq.tail_block_id is not None:   # never matchable: reuse it first, like vLLM's unhashed blocks
            self.free_block_ids.appendleft(seq.tail_block_id)
        for chunk in reversed(seq.chunks):  # leaf first, as vLLM frees a request's blocks
            chunk.last_access = self._clock
            self._unpin(chunk)

    def evict(self, num_blocks: int) -> list[int]:
        """Free up to num_blocks cached chunks, leaf first, least recently released first.
        Returns the evicted block ids (now free)."""
        evicted = []
        while len(evicted) < num_blocks and self._evictable:
            _, entry_id, chunk = heapq.heappop(self._evict_heap)
            if self._evictable.get(chunk) != entry_id:
                continue                    # stale entry: the chunk was pinned since it was pushed
            del self._evictable[chunk]
            parent = chunk.parent
            del parent.children[chunk.key]
            chunk.listed, chunk.parent = False, None
            self.num_cached_blocks -= 1
            self.num_evictions += 1
            self.free_block_ids.append(chunk.block_id)
            evicted.append(chunk.block_id)
            if self.aux is not None:
                self.aux.on_evict(chunk)
            if self.event_log is not None:
                self.event_log.append((EVICTED, chunk))
            if parent is not self.root and parent.ref_count == 0 and not parent.children:
                self._push_evictable(parent)
        return evicted

    def reset(self) -> bool:
        """vLLM's reset_prefix_cache: refuse while any block is in use, else drop every cached chunk."""
        if self.pool_size - len(self.free_block_ids) - self.num_reclaimable_blocks > 0:
            return False
        if self.aux is not None:
            self.aux.clear()
        self._clear()
        if self.event_log is not None:
            self.event_log.append((CLEARED, None))
        return True

    def block_ids(self, seq_id: Hashable) -> list[int]:
        """The sequence's block table row: full chunks, then the partial tail if any."""
        seq = self.seqs[seq_id]
        tail = [] if seq.tail_block_id is None else [seq.tail_block_id]
        return [chunk.block_id for chunk in seq.chunks] + tail

    def num_tokens(self, seq_id: Hashable) -> int:
        seq = self.seqs[seq_id]
        return len(seq.chunks) * self.block_size + len(seq.tail_token_ids)

    def dfs_order(self) -> list[Hashable]:
        """Live sequences in a DFS order of the tree (children by block id): sharers are adjacent."""
        return sorted(self.seqs, key=lambda seq_id: [chunk.block_id for chunk in self.seqs[seq_id].chunks])

    def sharing_groups(self, seq_ids: Sequence[Hashable]) -> tuple[list[SharedNode], list[int]]:
        """The sharing structure build_plan derives from these sequences' block tables (row i = seq_ids[i]).

        Returns (nodes, seq_num_shared_blocks): a node is (block_ids, rows), a maximal run of chunks
        held by the same >= 2 rows; seq_num_shared_blocks[i] is the first private column of row i.
        Cost: O(chunks of the batch).
        """
        holders: dict[Chunk, list[int]] = {}
        for row, seq_id in enumerate(seq_ids):
            for chunk in self.seqs[seq_id].chunks:
                holders.setdefault(chunk, []).append(row)
        nodes, seq_num_shared_blocks, emitted = [], [], set()
        for seq_id in seq_ids:
            chunks = self.seqs[seq_id].chunks
            num_shared = 0
            while num_shared < len(chunks) and len(holders[chunks[num_shared]]) >= 2:
                num_shared += 1
            seq_num_shared_blocks.append(num_shared)
            # Holder sets only shrink along a path (a child's holders hold its parent), so a run of
            # equal holder counts is a run of equal holder sets.
            start = 0
            for end in range(1, num_shared + 1):
                if end < num_shared and len(holders[chunks[end]]) == len(holders[chunks[start]]):
                    continue
                if chunks[start] not in emitted:
                    emitted.add(chunks[start])
                    block_ids = tuple(chunk.block_id for chunk in chunks[start:end])
                    nodes.append((block_ids, tuple(holders[chunks[start]])))
                start = end
        return nodes, seq_num_shared_blocks

    @property
    def num_reclaimable_blocks(self) -> int:
        """Blocks that hold cached KV and can be evicted: cached chunks, and what `aux` holds."""
        return self.num_cached_blocks + (self.aux.num_reclaimable if self.aux is not None else 0)

    def stats(self) -> TreeStats:
        num_free, num_cached = len(self.free_block_ids), self.num_reclaimable_blocks
        return TreeStats(num_free, self.pool_size - num_free - num_cached,
                         num_cached, self.num_hit_tokens, self.num_query_tokens,
                         self.num_evictions, self.num_shared_tokens)

    def check_invariants(self) -> None:
        """Recount everything from scratch (O(tree), for tests and CHUNKATTN_DEBUG_TREE) and
        assert it matches the counters (tree_invariants.py)."""
        from .tree_invariants import check_invariants
        check_invariants(self)

    ##### Internal Helper Functions #####

    def _clear(self) -> None:
        self.root = Chunk(-1, (), ref_count=1, listed=True)     # root is pinned, never evicted
        self.free_block_ids = deque(b for b in range(self.num_blocks) if b not in self.reserved)
        self.num_cached_blocks = 0
        self._evictable: dict[Chunk, int] = {}  # ref-0 listed chunks without children -> live heap entry
        self._evict_heap: list[tuple[int, int, Chunk]] = []  # (last_access, entry_id, chunk), lazily pruned

    def _allocate_block(self) -> int:
        if not self.free_block_ids and not (self.aux is not None and self.aux.reclaim()):
            self.evict(1)
        return self.free_block_ids.popleft()

    def _fill(self, seq: _SequenceBlocks, token_ids: Sequence[int], new_block_ids: list[int]) -> None:
        new_blocks = iter(new_block_ids)
        pos = 0
        while pos < len(token_ids):
            if seq.tail_block_id is None:
                seq.tail_block_id = next(new_blocks)
            num_taken = self.block_size - len(seq.tail_token_ids)
            seq.tail_token_ids.extend(token_ids[pos:pos + num_taken])
            pos += num_taken
            if len(seq.tail_token_ids) == self.block_size:
                self._seal_tail(seq)
        assert next(new_blocks, None) is None, "allocated more blocks than filled"

    def _seal_tail(self, seq: _SequenceBlocks) -> None:
        """The tail block just became full: it turns into a chunk, listed unless it duplicates one."""
        parent = seq.chunks[-1] if seq.chunks else self.root
        namespace = chunk_namespace(seq.namespace, len(seq.chunks), self.block_size)
        chunk = Chunk(seq.tail_block_id, tuple(seq.tail_token_ids), namespace, parent, ref_count=1,
                      depth=len(seq.chunks))
        self._list_if_new(chunk)
        seq.chunks.append(chunk)
        seq.tail_block_id, seq.tail_token_ids = None, []

    def _list_if_new(self, chunk: Chunk) -> None:
        """Make a full chunk matchable, unless its parent is not, a sibling already holds its
        content (a duplicate), or a token of it is still pending."""
        parent = chunk.parent
        if parent.listed and chunk.key not in parent.children and PENDING not in chunk.token_ids:
            parent.children[chunk.key] = chunk
            chunk.listed = True
            if self.event_log is not None:
                self.event_log.append((LISTED, chunk))

    def _pin(self, chunk: Chunk) -> None:
        if chunk.ref_count == 0:            # a cached chunk comes back into use
            self.num_cached_blocks -= 1
            self._evictable.pop(chunk, None)
        else:
            self.num_shared_tokens += self.block_size
        chunk.ref_count += 1

    def _unpin(self, chunk: Chunk) -> None:
        chunk.ref_count -= 1
        if chunk.ref_count > 0:
            self.num_shared_tokens -= self.block_size
        elif chunk.listed:
            self.num_cached_blocks += 1
            if not chunk.children:
                self._push_evictable(chunk)
        else:                               # unreachable by match_prefix: caching it would only leak
            chunk.parent = None
            self.free_block_ids.appendleft(chunk.block_id)

    def _push_evictable(self, chunk: Chunk) -> None:
        if len(self._evict_heap) > 2 * len(self._evictable) + 64:     # drop stale entries, amortized O(1)
            self._evict_heap = [(c.last_access, e, c) for c, e in self._evictable.items()]
            heapq.heapify(self._evict_heap)
        entry_id = next(self._entry_ids)
        self._evictable[chunk] = entry_id
        heapq.heappush(self._evict_heap, (chunk.last_access, entry_id, chunk))

