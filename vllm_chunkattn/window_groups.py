"""The blocks of sliding-window KV cache groups, beside a ChunkPrefixTree of the full-attention group.

vLLM's hybrid KV cache (gpt-oss, Gemma 2/3) gives full and sliding-window layers separate KV cache
groups that draw on one block pool: each block position of a sequence has one block in every
group. The tree's chunks are the full-attention group's blocks; this keeps, per chunk, a *bundle*
of one block per window group, in lockstep with the tree (a new block position gets a bundle when
the tree allocates it). What the windows gain over full-length KV for windowed layers:
- a sequence lets go of the bundles of chunks that fell out of its window (vLLM's
  `SlidingWindowManager.get_num_skipped_tokens`); a bundle no live window holds stays cached,
  least recently released first reclaimed, for later hits, or is freed at once when its chunk
  is not matchable;
- a prefix hit ends where the last ceil((W - 1) / block_size) chunks still have their bundles
  (what vLLM's sliding-window hit search asks), and its window blocks before them are vLLM's
  null block 0, as in stock's block tables.
A bundle's blocks are shared by every sequence whose window holds its chunk, so a decode plan
built from a window group's block table reads them once for all of them.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from .tree import Chunk, ChunkPrefixTree

NULL_BLOCK = 0


@dataclass(slots=True, eq=False)
class _WindowSeq:
    start: int                              # its chunks before this one are out of its window
    num_hit_chunks: int                     # its chunks from the hit it was admitted on
    num_own_chunks: int = 0                 # the chunks it filled since, bundles its own
    tail: tuple[int, ...] | None = None     # the bundle of its partial tail block


class WindowGroups:
    """Window-group blocks of a tree's sequences. `num_groups` groups share one window."""

    def __init__(self, tree: ChunkPrefixTree, num_groups: int, window: int):
        assert num_groups >= 1 and window >= 1 and tree.aux is None
        self.tree, self.num_groups, self.window = tree, num_groups, window
        self.block_size = tree.block_size
        # Contiguous chunks with bundles a hit must end on: vLLM's cdiv(window - 1, block_size).
        self.hit_chunks = -(-(window - 1) // self.block_size)
        self.bundles: dict[Chunk, tuple[int, ...]] = {}
        self.refs: dict[Chunk, int] = {}    # live sequences whose window holds the chunk
        self.cached: OrderedDict[Chunk, None] = OrderedDict()   # refs 0, least recent first
        self.seqs: dict[Hashable, _WindowSeq] = {}
        tree.aux = self

    ##### what the tree asks (tree.AuxBlocks) #####

    @property
    def num_reclaimable(self) -> int:
        return self.num_groups * len(self.cached)

    def num_pinned(self, chunks: Sequence[Chunk]) -> int:
        start = self.skipped_chunks(len(chunks) * self.block_size)
        return self.num_groups * sum(1 for c in chunks[start:] if c in self.cached)

    def reclaim(self) -> int:
        if not self.cached:
            return 0
        chunk, _ = self.cached.popitem(last=False)
        self._free(self.bundles.pop(chunk))
        del self.refs[chunk]
        return self.num_groups

    def on_evict(self, chunk: Chunk) -> None:
        if chunk in self.cached:
            del self.cached[chunk], self.refs[chunk]
            self._free(self.bundles.pop(chunk))

    def clear(self) -> None:
        assert not self.seqs, "reset with sequences live"
        self.bundles.clear()
        self.refs.clear()
        self.cached.clear()

    def owned_blocks(self) -> Iterable[tuple[int, object]]:
        for chunk, bundle in self.bundles.items():
            for block_id in bundle:
                yield block_id, ("window", chunk.block_id)
        for seq_id, seq in self.seqs.items():
            for block_id in seq.tail or ():
                yield block_id, ("window tail", seq_id)

    def check_invariants(self) -> None:
        expected: dict[Chunk, int] = {}
        for seq_id, seq in self.seqs.items():
            chunks = self.tree.seqs[seq_id].chunks
            assert 0 <= seq.start <= len(chunks), seq_id
            assert (seq.tail is None) == (self.tree.seqs[seq_id].tail_block_id is None), seq_id
            for chunk in chunks[seq.start:]:
                expected[chunk] = expected.get(chunk, 0) + 1
        assert set(self.refs) == set(self.bundles)
        for chunk, refs in self.refs.items():
            assert refs == expected.get(chunk, 0), f"window refs of chunk {chunk.block_id}"
            assert (refs == 0) == (chunk in self.cached), f"chunk {chunk.block_id} cached flag"
            assert refs > 0 or chunk.listed, f"unlisted chunk {chunk.block_id} kept its bundle"
            assert len(self.bundles[chunk]) == self.num_groups
        assert not set(expected) - set(self.refs), "a window holds a chunk without a bundle"

    ##### what the KV cache manager asks #####

    def skipped_chunks(self, num_computed_tokens: int) -> int:
        """Chunks wholly before the window of the token after num_computed_tokens."""
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def hit_length(self, matched: Sequence[Chunk]) -> int:
        """How many of the tree's matched chunks a hit can use: the longest run that ends on
        enough chunks with bundles for the next token's window (all of them when fewer)."""
        if not self.hit_chunks:
            return len(matched)
        run = 0                             # chunks with bundles from index i on, right to left
        for i in range(len(matched) - 1, -1, -1):
            if matched[i] not in self.bundles:
                run = 0
                continue
            run += 1
            if run == self.hit_chunks:
                return i + run
        return run                          # a run from the first chunk, shorter than needed

    def num_new_blocks(self, num_new_positions: int) -> int:
        return self.num_groups * num_new_positions

    def admit(self, seq_id: Hashable, matched: Sequence[Chunk]) -> None:
        """Before the tree admits the sequence on `matched` (a hit_length run): hold the
        bundles its window needs, so that the tree's allocations cannot reclaim them."""
        start = self.skipped_chunks(len(matched) * self.block_size)
        for chunk in matched[start:]:
            self._hold(chunk)
        self.seqs[seq_id] = _WindowSeq(start, len(matched))

    def sync(self, seq_id: Hashable) -> list[list[int]]:
        """After the tree gave the sequence new block positions: a bundle for each, and chunks
        the sequence just filled take theirs. Returns, per window group, the new positions'
        blocks."""
        seq, tree_seq = self.seqs[seq_id], self.tree.seqs[seq_id]
        chunks = tree_seq.chunks
        num_positions = len(chunks) + (tree_seq.tail_block_id is not None)
        num_synced = seq.num_hit_chunks + seq.num_own_chunks
        new = [self._allocate() for _ in range(num_positions - num_synced
                                               - (seq.tail is not None))]
        bundles = ([seq.tail] if seq.tail is not None else []) + new
        for chunk in chunks[num_synced:]:   # sealed since the last sync: in its window
            self.bundles[chunk], self.refs[chunk] = bundles.pop(0), 1
            seq.num_own_chunks += 1
        seq.tail = bundles.pop(0) if bundles else None
        assert not bundles
        return [[bundle[g] for bundle in new] for g in range(self.num_groups)]

    def release_skipped(self, seq_id: Hashable, num_processed_tokens: int) -> None:
        """vLLM's remove_skipped_blocks: let go of chunks no later token's window reads."""
        seq = self.seqs[seq_id]
        chunks = self.tree.seqs[seq_id].chunks
        start = min(self.skipped_chunks(num_processed_tokens), len(chunks))
        for chunk in chunks[seq.start:start]:
            self._unhold(chunk)
        seq.start = max(seq.start, start)

    def release(self, seq_id: Hashable) -> None:
        """Before the tree releases the sequence."""
        seq = self.seqs.pop(seq_id)
        for chunk in reversed(self.tree.seqs[seq_id].chunks[seq.start:]):
            self._unhold(chunk)
        if seq.tail is not None:
            self._free(seq.tail)

    def block_ids(self, seq_id: Hashable) -> list[list[int]]:
        """The sequence's row in each window group's block table (null before its window)."""
        seq = self.seqs[seq_id]
        chunks = self.tree.seqs[seq_id].chunks
        bundles = [self.bundles[c] for c in chunks[seq.start:]]
        if seq.tail is not None:
            bundles.append(seq.tail)
        return [[NULL_BLOCK] * seq.start + [b[g] for b in bundles]
                for g in range(self.num_groups)]

    def hit_block_ids(self, matched: Sequence[Chunk]) -> list[list[int]]:
        """A hit's rows in each window group's block table (matched: a hit_length run)."""
        start = self.skipped_chunks(len(matched) * self.block_size)
        return [[NULL_BLOCK] * start + [self.bundles[c][g] for c in matched[start:]]
                for g in range(self.num_groups)]

    ##### internals #####

    def _hold(self, chunk: Chunk) -> None:
        refs = self.refs[chunk]
        if refs == 0:
            del self.cached[chunk]
        self.refs[chunk] = refs + 1

    def _unhold(self, chunk: Chunk) -> None:
        refs = self.refs[chunk] - 1
        self.refs[chunk] = refs
        if refs:
            return
        if chunk.listed:
            self.cached[chunk] = None       # least recently released last
            return
        del self.refs[chunk]
        bundle = self.bundles.pop(chunk)
        twin = self._listed_twin(chunk)
        if twin is not None and twin not in self.bundles:
            # A duplicate of a listed chunk whose window blocks were reclaimed: the same tokens
            # after the same prefix, so the same KV. The listed one takes them, as stock's
            # cache finds a block of that hash in each group, whichever request filled it.
            self.bundles[twin], self.refs[twin] = bundle, 0
            self.cached[twin] = None
        else:                               # nothing can match it: no hit would read it
            self._free(bundle)

    def _listed_twin(self, chunk: Chunk | None) -> Chunk | None:
        """The listed chunk of the same tokens after the same prefix, if any."""
        if chunk is None or chunk.listed:
            return chunk
        parent = self._listed_twin(chunk.parent)
        return None if parent is None else parent.children.get(chunk.key)

    def _allocate(self) -> tuple[int, ...]:
        return tuple(self.tree._allocate_block() for _ in range(self.num_groups))

    def _free(self, bundle: tuple[int, ...]) -> None:
        self.tree.free_block_ids.extendleft(bundle)
