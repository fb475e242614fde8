"""ChunkPrefixTree: vLLM's prefix-caching scenarios, a stateful property test against a brute-force
model, and agreement with build_plan on the sharing structure of a batch."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vllm_chunkattn.plan import build_plan
from vllm_chunkattn.tree import PENDING, ChunkPrefixTree, SplitNamespace

BLOCK_SIZE = 4
NUM_BLOCKS = 11             # vLLM's test pool: block 0 is the null block, 10 usable


def make_tree(num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE) -> ChunkPrefixTree:
    return ChunkPrefixTree(num_blocks, block_size)


def tokens(num_tokens: int, start: int = 0) -> list[int]:
    return list(range(start, start + num_tokens))


def ref_counts(tree: ChunkPrefixTree, token_ids, namespace=None) -> list[int]:
    return [chunk.ref_count for chunk in tree.match_prefix(token_ids, namespace)]


# ---------------------------------------------------------------- allocation and hits

def test_cold_prefill_only_full_chunks_are_matchable():
    tree = make_tree()
    prompt = tokens(3 * BLOCK_SIZE + 3)
    assert tree.add_sequence("a", prompt) == 0
    table = tree.block_ids("a")
    assert len(table) == 4 and 0 not in table
    matched = tree.match_prefix(prompt + [99])          # 16 tokens, but the 4th block is partial
    assert [chunk.block_id for chunk in matched] == table[:3]
    assert [chunk.ref_count for chunk in matched] == [1, 1, 1]
    stats = tree.stats()
    assert (stats.num_free_blocks, stats.num_in_use_blocks, stats.num_cached_blocks) == (6, 4, 0)
    tree.check_invariants()


def test_second_request_shares_prefix_blocks_while_first_runs():
    tree = make_tree()
    prompt = tokens(3 * BLOCK_SIZE + 3)
    tree.add_sequence("a", prompt)
    free_before = tree.stats().num_free_blocks
    assert tree.add_sequence("b", prompt[:12] + [50, 51]) == 12
    assert tree.block_ids("b")[:3] == tree.block_ids("a")[:3]
    assert tree.stats().num_free_blocks == free_before - 1      # exactly one new block, the tail
    assert ref_counts(tree, prompt) == [2, 2, 2]
    assert tree.stats().num_shared_tokens == 3 * BLOCK_SIZE
    tree.check_invariants()


def test_hit_after_both_owners_released_takes_blocks_back_from_cache():
    tree = make_tree()
    prompt = tokens(3 * BLOCK_SIZE + 3)
    tree.add_sequence("a", prompt)
    tree.add_sequence("b", prompt[:12] + [50, 51])
    shared = tree.block_ids("a")[:3]
    tree.release("a")
    tree.release("b")
    stats = tree.stats()
    assert (stats.num_free_blocks, stats.num_in_use_blocks, stats.num_cached_blocks) == (7, 0, 3)
    assert ref_counts(tree, prompt) == [0, 0, 0]
    assert tree.add_sequence("c", prompt[:12] + [60]) == 12
    assert tree.block_ids("c")[:3] == shared
    stats = tree.stats()
    assert (stats.num_free_blocks, stats.num_in_use_blocks, stats.num_cached_blocks) == (6, 4, 0)
    assert stats.num_hit_tokens == 24 and stats.num_query_tokens == 15 + 14 + 13
    tree.check_invariants()


def test_fully_cached_prompt_still_leaves_one_token_to_compute():
    tree = make_tree()
    prompt = tokens(2 * BLOCK_SIZE)                     # block-aligned
    tree.add_sequence("a", prompt)
    first = tree.block_ids("a")
    tree.release("a")
    assert len(tree.match_prefix(prompt)) == 2
    assert len(tree.match_prefix(prompt, max_tokens=len(prompt) - 1)) == 1     # one block short
    assert tree.add_sequence("b", prompt, max_shared_tokens=len(prompt) - 1) == BLOCK_SIZE
    second = tree.block_ids("b")
    assert second[0] == first[0] and second[1] != first[1]
    # The recomputed block duplicates a cached chunk: it gets no match entry of its own.
    assert [chunk.block_id for chunk in tree.match_prefix(prompt)] == first
    tree.check_invariants()
    tree.release("b")
    assert tree.stats().num_cached_blocks == 2                  # the duplicate was freed, not cached
    tree.check_invariants()


def test_decode_growth_allocates_one_block_per_boundary_and_filled_block_becomes_matchable():
    tree = make_tree()
    tree.add_sequence("a", tokens(6))                   # one full chunk + a 2-token tail
    assert tree.append("a", [6]) == []
    assert len(tree.match_prefix(tokens(8))) == 1
    assert tree.append("a", [7]) == []                  # fills the tail: no new block...
    assert [c.block_id for c in tree.match_prefix(tokens(8))] == tree.block_ids("a")  # ...but matchable
    new = tree.append("a", [8])
    assert len(new) == 1 and tree.block_ids("a")[-1] == new[0]
    assert len(tree.append("a", tokens(8, start=9))) == 2      # 9 -> 17 tokens crosses two boundaries
    assert tree.num_tokens("a") == 17 and len(tree.block_ids("a")) == 5
    assert len(tree.match_prefix(tokens(17))) == 4
    tree.check_invariants()


def test_prompt_shorter_than_a_block_does_not_leak():
    tree = make_tree()
    tree.add_sequence("a", [1, 2])
    assert tree.match_prefix([1, 2]) == []
    tree.release("a")
    stats = tree.stats()
    assert (stats.num_free_blocks, stats.num_in_use_blocks, stats.num_cached_blocks) == (10, 0, 0)
    tree.check_invariants()


def test_duplicate_full_chunk_keeps_own_block_without_a_second_match_entry():
    tree = make_tree()
    tree.add_sequence("a", [1, 2])
    tree.add_sequence("b", [1, 2])
    tree.append("a", [3, 4])
    tree.append("b", [3, 4])                            # same content, separate physical block
    block_a, block_b = tree.block_ids("a")[0], tree.block_ids("b")[0]
    assert block_a != block_b
    assert [c.block_id for c in tree.match_prefix([1, 2, 3, 4])] == [block_a]
    tree.append("b", [5, 6, 7, 8])                      # below a duplicate: not matchable either
    assert len(tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])) == 1
    tree.check_invariants()
    tree.release("b")
    tree.release("a")
    assert tree.stats().num_cached_blocks == 1
    tree.check_invariants()


# ---------------------------------------------------------------- eviction and failure

def test_eviction_is_leaf_first_then_lru_by_release_time():
    tree = make_tree(num_blocks=20)
    shared = tokens(4, start=100)
    tree.add_sequence("q", tokens(4, start=200) + [0])
    tree.add_sequence("x", shared + tokens(4, start=300) + [0])
    tree.add_sequence("y", shared + tokens(4, start=400) + [0])
    tree.add_sequence("r", tokens(4, start=500) + [0])
    q, (p, x), (_, y), r = (tree.block_ids(s)[:-1] for s in "qxyr")
    for seq_id in "qxyr":                               # release times: q < x < y < r
        tree.release(seq_id)
    # p was released with y, but it is a parent: it goes only after both its children.
    assert [tree.evict(1) for _ in range(5)] == [q, [x], [y], [p], r]
    assert tree.evict(1) == [] and tree.stats().num_evictions == 5
    tree.check_invariants()


def test_rehit_chunk_leaves_the_eviction_queue():
    tree = make_tree()
    tree.add_sequence("a", tokens(5))
    tree.add_sequence("b", tokens(5, start=50))
    chunk_b = tree.block_ids("b")[0]
    tree.release("a")                                   # a's chunk is the least recently released
    tree.release("b")
    tree.add_sequence("c", tokens(5))                   # pins a's chunk again
    assert tree.evict(2) == [chunk_b]
    assert tree.match_prefix(tokens(4))[0].ref_count == 1
    tree.check_invariants()


def test_matched_prefix_is_never_evicted_by_its_own_allocation():
    tree = make_tree()
    prompt = tokens(3 * BLOCK_SIZE)
    tree.add_sequence("a", prompt + [0])
    tree.add_sequence("c", tokens(4, start=50) + [0])
    prefix = tree.block_ids("a")[:3]
    tree.release("a")
    tree.release("c")
    assert tree.stats().num_cached_blocks == 4          # 3 + 1, and 6 free
    # 3 matched + 8 new blocks: 6 free + 1 cached elsewhere is one short. Nothing may change.
    assert tree.add_sequence("b", prompt + tokens(29, start=1000)) is None
    assert ref_counts(tree, prompt) == [0, 0, 0] and tree.stats().num_evictions == 0
    # 3 matched + 7 new blocks: fits by evicting c's chunk, never the matched ones.
    assert tree.add_sequence("b", prompt + tokens(28, start=1000)) == 12
    assert tree.block_ids("b")[:3] == prefix
    assert tree.stats().num_evictions == 1 and tree.match_prefix(tokens(4, start=50)) == []
    tree.check_invariants()


def test_failed_allocation_leaves_every_refcount_unchanged():
    tree = make_tree()
    prompt = tokens(2 * BLOCK_SIZE + 1)
    tree.add_sequence("a", prompt)
    tree.add_sequence("b", prompt[:8] + [77])
    tree.add_sequence("old", tokens(4, start=500) + [1])
    tree.release("old")                                 # 4 blocks in use, 1 cached, 5 free

    def snapshot():
        return ref_counts(tree, prompt), tree.block_ids("a"), tree.block_ids("b"), tree.stats()

    before = snapshot()
    assert tree.add_sequence("big", prompt[:8] + tokens(7 * BLOCK_SIZE)) is None    # 7 new > 6
    assert tree.append("a", tokens(7 * BLOCK_SIZE)) is None                         # 7 new > 6
    assert snapshot() == before and "big" not in tree.seqs
    assert tree.add_sequence("fill", tokens(5 * BLOCK_SIZE + 1, start=900)) == 0    # pool now full
    before = snapshot()
    assert tree.fork("a", "a2") is None                 # no block left for the copied tail
    assert snapshot() == before and "a2" not in tree.seqs
    assert tree.fork("fill", "fill2") is None
    tree.check_invariants()


def test_pending_slots_are_never_matched_until_resolved():
    """Async scheduling: a decode slot is allocated before its token is sampled."""
    tree = make_tree()
    prompt = tokens(BLOCK_SIZE + 2)
    tree.add_sequence("a", prompt)
    assert tree.append("a", [], num_pending=2) == []          # fills the tail: no new block
    assert tree.num_tokens("a") == 2 * BLOCK_SIZE
    sealed = tree.seqs["a"].chunks[-1]
    assert sealed.token_ids[-2:] == (PENDING, PENDING) and not sealed.listed
    assert len(tree.match_prefix(prompt[:BLOCK_SIZE] + [PENDING] * BLOCK_SIZE + [0])) == 1
    with pytest.raises(AssertionError, match="resolve"):
        tree.append("a", [7])                                 # known after pending: refused
    [new_block] = tree.append("a", [], num_pending=1)         # the next step's slot, new block
    tree.check_invariants()
    tree.resolve("a", [50, 51])                               # step N's and N+1's tokens
    tree.check_invariants()
    assert sealed.listed and sealed.token_ids[-2:] == (50, 51)
    full = prompt + [50, 51]
    assert [c.block_id for c in tree.match_prefix(full + [0])] == tree.block_ids("a")[:2]
    assert tree.seqs["a"].tail_token_ids == [PENDING] and tree.block_ids("a")[-1] == new_block
    tree.resolve("a", [52])
    assert tree.seqs["a"].tail_token_ids == [52] and tree.seqs["a"].num_pending == 0
    tree.check_invariants()


def test_resolving_a_duplicate_keeps_one_match_entry_and_release_frees_pending():
    tree = make_tree()
    tree.add_sequence("a", tokens(2 * BLOCK_SIZE))            # both chunks listed
    tree.add_sequence("b", tokens(BLOCK_SIZE + 1))            # shares chunk 0
    tree.append("b", [], num_pending=BLOCK_SIZE - 1)          # chunk 1 of b: all pending but one
    tree.resolve("b", tokens(BLOCK_SIZE - 1, BLOCK_SIZE + 1))  # same content as a's chunk 1
    b_chunk = tree.seqs["b"].chunks[1]
    assert not b_chunk.listed and tree.seqs["a"].chunks[1].listed   # a duplicate stays unlisted
    tree.check_invariants()
    tree.add_sequence("c", tokens(BLOCK_SIZE))
    tree.append("c", [], num_pending=3)
    free_before = len(tree.free_block_ids)
    tree.release("c")                                         # preempted with a pending slot
    assert len(tree.free_block_ids) == free_before + 1
    tree.release("b")
    tree.check_invariants()


def test_namespaces_never_share():
    tree = make_tree(num_blocks=20)
    prompt = tokens(2 * BLOCK_SIZE + 1)
    assert tree.add_sequence("plain", prompt) == 0
    assert tree.add_sequence("lora", prompt, namespace=("lora", "adapter-1")) == 0
    assert tree.add_sequence("salted", prompt, namespace=("cache_salt", "s")) == 0
    tables = [set(tree.block_ids(s)) for s in ("plain", "lora", "salted")]
    assert not (tables[0] & tables[1]) and not (tables[0] & tables[2]) and not (tables[1] & tables[2])
    lora_chunks = tree.match_prefix(prompt, ("lora", "adapter-1"))
    assert [c.block_id for c in lora_chunks] == tree.block_ids("lora")[:2]
    assert tree.match_prefix(prompt, ("lora", "adapter-2")) == []
    tree.check_invariants()


def test_split_namespace_shares_only_the_chunks_before_the_split():
    """Multimodal prompts: chunks ending at or before the first placeholder are plain text."""
    tree = make_tree(num_blocks=20)
    prompt = tokens(4 * BLOCK_SIZE + 1)
    image_a = SplitNamespace(None, "img-a", 2 * BLOCK_SIZE + 1)     # placeholder inside chunk 2
    assert tree.add_sequence("a", prompt, image_a) == 0
    assert tree.add_sequence("b", prompt, SplitNamespace(None, "img-b", 2 * BLOCK_SIZE + 1)) \
        == 2 * BLOCK_SIZE
    a, b = tree.block_ids("a"), tree.block_ids("b")
    assert b[:2] == a[:2] and not set(b[2:]) & set(a)
    assert [c.block_id for c in tree.match_prefix(prompt)] == a[:2]        # text only
    assert [c.block_id for c in tree.match_prefix(prompt, image_a)] == a[:4]
    # A placeholder starting exactly at a chunk boundary leaves the chunk before it plain text.
    assert len(tree.match_prefix(prompt, SplitNamespace(None, "img-c", 2 * BLOCK_SIZE))) == 2
    assert len(tree.match_prefix(prompt, SplitNamespace(None, "img-c", 2 * BLOCK_SIZE - 1))) == 1
    # Chunks filled by decoding are keyed like the rest of the sequence after the split.
    tree.append("a", tokens(BLOCK_SIZE - 1, start=700))
    grown = prompt + tokens(BLOCK_SIZE - 1, start=700)
    assert [c.block_id for c in tree.match_prefix(grown, image_a)] == a[:5]
    assert len(tree.match_prefix(grown, SplitNamespace(None, "img-b", 2 * BLOCK_SIZE + 1))) == 4
    tree.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_a_match_extended_from_the_last_one_is_the_match_from_scratch(seed):
    """The scheduler re-matches each waiting request every step from its previous match
    (`previous`): through admissions, decode growth, releases, evictions (a small pool) and
    resets, the result is always what a match from the root gives."""
    rng = random.Random(seed)
    tree = make_tree(num_blocks=24)
    stems = [tokens(3 * BLOCK_SIZE, start=100 * i) for i in range(3)]

    def prompt() -> list[int]:
        stem = rng.choice(stems)[:rng.randrange(0, 3 * BLOCK_SIZE + 1)]
        return stem + [rng.randrange(1000, 1003) for _ in range(rng.randrange(0, 2 * BLOCK_SIZE))]

    waiting = [(prompt(), rng.choice([None, "lora"])) for _ in range(8)]
    previous: dict[int, list] = {}
    live, kept, extended = [], 0, 0
    for step in range(200):
        op = rng.random()
        if op < 0.35 and len(live) < 5:
            name = f"s{step}"
            if tree.add_sequence(name, prompt() + [7], rng.choice([None, "lora"])) is not None:
                live.append(name)
        elif op < 0.6 and live:
            tree.append(rng.choice(live), [rng.randrange(1000, 1003) for _ in range(rng.randrange(1, 6))])
        elif op < 0.85 and live:
            tree.release(live.pop(rng.randrange(len(live))))
        elif op < 0.95:
            tree.evict(rng.randrange(1, 4))
        elif not live:
            tree.reset()
        for i, (ids, ns) in enumerate(waiting):
            got = tree.match_prefix(ids, ns, len(ids) - 1, previous=previous.get(i, ()))
            assert got == tree.match_prefix(ids, ns, len(ids) - 1), (step, i)
            kept += bool(previous.get(i)) and got[:1] == previous[i][:1]
            extended += len(got) > len(previous.get(i, ()))
            previous[i] = got
        tree.check_invariants()
    assert kept > 50 and extended > 10          # the kept head and the extension both ran


def test_reset_refuses_while_in_use_and_clears_after():
    tree = make_tree()
    prompt = tokens(2 * BLOCK_SIZE + 1)
    tree.add_sequence("a", prompt)
    before = tree.stats()
    assert tree.reset() is False and tree.stats() == before
    assert len(tree.match_prefix(prompt)) == 2
    tree.release("a")
    assert tree.reset() is True
    assert tree.match_prefix(prompt) == [] and tree.stats().num_free_blocks == NUM_BLOCKS - 1
    tree.check_invariants()


def test_fork_shares_full_chunks_and_copies_the_tail():
    tree = make_tree(num_blocks=30)
    prompt = tokens(2 * BLOCK_SIZE + 2)
    tree.add_sequence("s0", prompt)
    tail = tree.block_ids("s0")[-1]
    for i in range(1, 4):                               # n = 4
        [(src, dst)] = tree.fork("s0", f"s{i}")
        assert src == tail and tree.block_ids(f"s{i}") == tree.block_ids("s0")[:2] + [dst]
    assert len({tree.block_ids(f"s{i}")[-1] for i in range(4)}) == 4
    assert ref_counts(tree, prompt) == [4, 4]
    assert tree.stats().num_shared_tokens == 2 * 3 * BLOCK_SIZE
    for i in range(4):
        tree.append(f"s{i}", [1000 + i] * 3)
    tree.check_invariants()
    for i in range(4):
        tree.release(f"s{i}")
    assert ref_counts(tree, prompt) == [0, 0]
    assert tree.stats().num_in_use_blocks == 0 and tree.stats().num_cached_blocks == 2 + 4
    aligned = make_tree()
    aligned.add_sequence("a", tokens(BLOCK_SIZE))
    assert aligned.fork("a", "b") == [] and ref_counts(aligned, tokens(BLOCK_SIZE)) == [2]
    tree.check_invariants()


def test_dfs_order_puts_sharers_next_to_each_other():
    tree = make_tree(num_blocks=40)
    rng = random.Random(0)
    prefixes = [tokens(8, start=100 * k) for k in range(3)]
    for i in range(12):
        tree.add_sequence(i, rng.choice(prefixes) + tokens(rng.randint(1, 6), start=1000 + 10 * i))
    order = tree.dfs_order()
    assert sorted(order) == list(range(12))
    nodes, _ = tree.sharing_groups(order)
    assert len(nodes) == 3
    for _, rows in nodes:
        assert list(rows) == list(range(rows[0], rows[-1] + 1))


# ---------------------------------------------------------------- agreement with build_plan

def random_live_batch(seed: int) -> tuple[ChunkPrefixTree, list[int]]:
    """Prompts drawn from a few shared prefixes, forks (whose tails then fill into shared
    duplicates), decode steps and releases; returns the tree and its live sequences shuffled."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    tree = ChunkPrefixTree(400, block_size)
    prefixes = [[rng.randrange(3) for _ in range(rng.randint(0, 12))] for _ in range(4)]
    next_id = 0
    for step in range(rng.randint(1, 30) + 2):
        op = 0.0 if step < 2 else rng.random()
        if op < 0.4 or not tree.seqs:
            prompt = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randint(1, 6))]
            tree.add_sequence(next_id, prompt, max_shared_tokens=rng.choice([None, len(prompt) - 1]))
        elif op < 0.6:
            tree.fork(rng.choice(list(tree.seqs)), next_id)
        elif op < 0.9:
            tree.append(rng.choice(list(tree.seqs)), [rng.randrange(2) for _ in range(rng.randint(1, 5))])
            continue
        else:
            tree.release(rng.choice(list(tree.seqs)))
            continue
        next_id += 1
    while len(tree.seqs) < 2:
        tree.add_sequence(next_id, rng.choice(prefixes) + [rng.randrange(3)])
        next_id += 1
    tree.check_invariants()
    live = list(tree.seqs)
    rng.shuffle(live)
    return tree, live


@pytest.mark.parametrize("seed", range(60))
def test_sharing_groups_agree_with_build_plan(seed):
    tree, live = random_live_batch(seed)
    tables = [tree.block_ids(s) for s in live]
    block_table = np.zeros((len(live), max(len(t) for t in tables)), np.int32)
    for row, table in enumerate(tables):
        block_table[row, :len(table)] = table
    seq_lens = np.array([tree.num_tokens(s) for s in live])
    plan = build_plan(block_table, seq_lens, tree.block_size)
    bi, bids = plan.node_block_indptr.tolist(), plan.node_block_ids.tolist()
    si, sids = plan.node_seq_indptr.tolist(), plan.node_seq_ids.tolist()
    plan_nodes = {(tuple(bids[bi[n]:bi[n + 1]]), frozenset(sids[si[n]:si[n + 1]]))
                  for n in range(plan.num_nodes)}
    nodes, seq_num_shared_blocks = tree.sharing_groups(live)
    assert {(blocks, frozenset(rows)) for blocks, rows in nodes} == plan_nodes
    assert len(nodes) == plan.num_nodes
    assert seq_num_shared_blocks == plan.seq_num_shared_blocks.tolist()


# ---------------------------------------------------------------- stateful property test

MODEL_BLOCK_SIZE = 2
MODEL_NUM_BLOCKS = 13       # 12 usable: small enough that allocation evicts and fails often
MODEL_POOL = MODEL_NUM_BLOCKS - 1
small_tokens = st.lists(st.integers(0, 1), min_size=1, max_size=7)


class TreeAgainstModel(RuleBasedStateMachine):
    """Brute force: each live sequence's tokens and block table, plus `cached_paths`, the full-chunk
    paths (namespace, tokens of the whole prefix) that are matchable, each with its block id. A path
    enters when a sequence fills a chunk whose parent is matchable and whose path is new (otherwise
    the block is a duplicate and never matchable); it leaves only when its block is evicted, which
    the model sees as the block id coming back from evict() or reappearing in a new allocation."""

    def __init__(self):
        super().__init__()
        self.tree = ChunkPrefixTree(MODEL_NUM_BLOCKS, MODEL_BLOCK_SIZE)
        self.seq_tokens: dict[int, list[int]] = {}
        self.seq_namespace: dict[int, object] = {}
        self.tables: dict[int, list[int]] = {}
        self.cached_paths: dict[tuple, int] = {}
        self.path_of_block: dict[int, tuple] = {}
        self.next_seq_id = 0

    # -- model helpers

    def path(self, namespace, token_ids, num_chunks: int) -> tuple:
        return (namespace, tuple(token_ids[:num_chunks * MODEL_BLOCK_SIZE]))

    def model_match(self, token_ids, namespace, max_tokens=None) -> list[int]:
        limit = len(token_ids) if max_tokens is None else min(len(token_ids), max_tokens)
        matched = []
        for j in range(1, limit // MODEL_BLOCK_SIZE + 1):
            block_id = self.cached_paths.get(self.path(namespace, token_ids, j))
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def in_use(self) -> set[int]:
        return {b for table in self.tables.values() for b in table}

    def num_reclaimable(self, pinned=()) -> int:
        free = MODEL_POOL - len(self.in_use() | set(self.path_of_block))
        return free + len(set(self.path_of_block) - self.in_use() - set(pinned))

    def forget_evicted(self, block_ids, in_use_before: set[int]) -> None:
        evicted = []
        for block_id in block_ids:
            assert block_id not in in_use_before, f"block {block_id} taken from a live sequence"
            if block_id in self.path_of_block:
                evicted.append(self.path_of_block.pop(block_id))
                del self.cached_paths[evicted[-1]]
        for namespace, gone in evicted:     # leaf first: nothing cached may hang below an evicted path
            assert not any(ns == namespace and len(p) > len(gone) and p[:len(gone)] == gone
                           for ns, p in self.cached_paths), "evicted a chunk with cached children"

    def seal_chunks(self, seq_id: int, first: int, end: int) -> None:
        tokens_, namespace, table = self.seq_tokens[seq_id], self.seq_namespace[seq_id], self.tables[seq_id]
        for j in range(first, end):
            path = self.path(namespace, tokens_, j + 1)
            parent_listed = j == 0 or self.cached_paths.get(self.path(namespace, tokens_, j)) == table[j - 1]
            if parent_listed and path not in self.cached_paths:
                self.cached_paths[path] = table[j]
                self.path_of_block[table[j]] = path

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // MODEL_BLOCK_SIZE)

    # -- rules

    @rule(data=st.data(), suffix=small_tokens, namespace=st.sampled_from([None, "lora"]), cap=st.booleans())
    def add(self, data, suffix, namespace, cap):
        prefix = []
        if self.seq_tokens and data.draw(st.booleans()):            # reuse a live prompt's prefix
            source = data.draw(st.sampled_from(sorted(self.seq_tokens)))
            prefix = self.seq_tokens[source][:data.draw(st.integers(0, 8))]
        token_ids = prefix + suffix
        max_shared = len(token_ids) - 1 if cap else None
        expected = self.model_match(token_ids, namespace, max_shared)
        assert [c.block_id for c in self.tree.match_prefix(token_ids, namespace, max_shared)] == expected
        num_new = self.blocks_needed(len(token_ids)) - len(expected)
        fits = num_new <= self.num_reclaimable(pinned=expected)
        in_use_before = self.in_use()
        seq_id = self.next_seq_id
        result = self.tree.add_sequence(seq_id, token_ids, namespace, max_shared)
        if not fits:
            assert result is None and seq_id not in self.tree.seqs
            return
        self.next_seq_id += 1
        assert result == len(expected) * MODEL_BLOCK_SIZE
        table = self.tree.block_ids(seq_id)
        assert table[:len(expected)] == expected and len(table) == len(expected) + num_new
        self.forget_evicted(table[len(expected):], in_use_before)
        self.seq_tokens[seq_id], self.seq_namespace[seq_id], self.tables[seq_id] = token_ids, namespace, table
        self.seal_chunks(seq_id, len(expected), len(token_ids) // MODEL_BLOCK_SIZE)

    @precondition(lambda self: self.seq_tokens)
    @rule(data=st.data(), new_tokens=small_tokens)
    def append(self, data, new_tokens):
        seq_id = data.draw(st.sampled_from(sorted(self.seq_tokens)))
        old_len = len(self.seq_tokens[seq_id])
        num_new = self.blocks_needed(old_len + len(new_tokens)) - self.blocks_needed(old_len)
        fits = num_new <= self.num_reclaimable()
        in_use_before = self.in_use()
        new_block_ids = self.tree.append(seq_id, new_tokens)
        if not fits:
            assert new_block_ids is None
            return
        assert len(new_block_ids) == num_new
        self.forget_evicted(new_block_ids, in_use_before)
        self.tables[seq_id] = self.tables[seq_id] + new_block_ids
        self.seq_tokens[seq_id] = self.seq_tokens[seq_id] + new_tokens
        new_len = len(self.seq_tokens[seq_id])
        self.seal_chunks(seq_id, old_len // MODEL_BLOCK_SIZE, new_len // MODEL_BLOCK_SIZE)

    @precondition(lambda self: self.seq_tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.seq_tokens)))
        has_tail = len(self.seq_tokens[parent]) % MODEL_BLOCK_SIZE != 0
        fits = not has_tail or self.num_reclaimable() >= 1
        in_use_before = self.in_use()
        child = self.next_seq_id
        copies = self.tree.fork(parent, child)
        if not fits:
            assert copies is None and child not in self.tree.seqs
            return
        self.next_seq_id += 1
        table = self.tree.block_ids(child)
        num_full = len(self.seq_tokens[parent]) // MODEL_BLOCK_SIZE
        assert table[:num_full] == self.tables[parent][:num_full]
        assert copies == ([(self.tables[parent][-1], table[-1])] if has_tail else [])
        self.forget_evicted(table[num_full:], in_use_before)
        self.seq_tokens[child] = list(self.seq_tokens[parent])
        self.seq_namespace[child] = self.seq_namespace[parent]
        self.tables[child] = table

    @precondition(lambda self: self.seq_tokens)
    @rule(data=st.data())
    def release(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seq_tokens)))
        self.tree.release(seq_id)
        for held in (self.seq_tokens, self.seq_namespace, self.tables):
            del held[seq_id]

    @rule(num_blocks=st.integers(0, 4))
    def evict(self, num_blocks):
        num_cached = len(set(self.path_of_block) - self.in_use())
        evicted = self.tree.evict(num_blocks)
        assert len(evicted) == min(num_blocks, num_cached)
        self.forget_evicted(evicted, self.in_use())

    @rule()
    def reset(self):
        assert self.tree.reset() == (not self.seq_tokens)
        if not self.seq_tokens:
            self.cached_paths.clear()
            self.path_of_block.clear()

    @rule(data=st.data(), suffix=small_tokens, namespace=st.sampled_from([None, "lora"]),
          max_tokens=st.none() | st.integers(0, 12))
    def match(self, data, suffix, namespace, max_tokens):
        token_ids = suffix
        if self.seq_tokens and data.draw(st.booleans()):
            token_ids = self.seq_tokens[data.draw(st.sampled_from(sorted(self.seq_tokens)))] + suffix
        matched = self.tree.match_prefix(token_ids, namespace, max_tokens)
        assert [c.block_id for c in matched] == self.model_match(token_ids, namespace, max_tokens)

    # -- invariants

    @invariant()
    def agrees_with_model(self):
        self.tree.check_invariants()
        in_use = self.in_use()
        for seq_id, table in self.tables.items():
            assert self.tree.block_ids(seq_id) == table
            for chunk in self.tree.match_prefix(self.seq_tokens[seq_id], self.seq_namespace[seq_id]):
                assert chunk.ref_count == sum(chunk.block_id in t for t in self.tables.values())
        stats = self.tree.stats()
        num_cached = len(set(self.path_of_block) - in_use)
        assert (stats.num_in_use_blocks, stats.num_cached_blocks) == (len(in_use), num_cached)
        assert stats.num_free_blocks + stats.num_in_use_blocks + stats.num_cached_blocks == MODEL_POOL

    def teardown(self):
        for seq_id in list(self.seq_tokens):
            self.tree.release(seq_id)
        self.tree.evict(MODEL_POOL)
        stats = self.tree.stats()
        assert (stats.num_free_blocks, stats.num_in_use_blocks, stats.num_cached_blocks) == (MODEL_POOL, 0, 0)
        assert stats.num_shared_tokens == 0
        self.tree.check_invariants()


TreeAgainstModel.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_tree_against_model = TreeAgainstModel.TestCase
