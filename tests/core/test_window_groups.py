"""WindowGroups: sliding-window KV cache groups' blocks beside the chunk prefix tree (no vLLM).
Hits end where the window's chunks still have their blocks (vLLM's sliding-window rule, checked
against a brute-force reading of it), released window blocks are cached and reclaimed before
chunks, a duplicate's window blocks go to its listed twin, and under random admissions, growth,
window moves and releases in a small pool every block a window reads is live and the books
balance (check_invariants)."""
from __future__ import annotations

import random

import pytest

from vllm_chunkattn.tree import ChunkPrefixTree, _num_blocks_for
from vllm_chunkattn.window_groups import WindowGroups

BS = 4


def make(num_blocks: int = 64, num_groups: int = 2, window: int = 6):
    tree = ChunkPrefixTree(num_blocks, BS)
    return tree, WindowGroups(tree, num_groups, window)


def admit(tree, win, seq_id, token_ids, max_hit_tokens=None) -> int | None:
    """What the KV cache manager does on admission (plugin/kv_cache_manager.py)."""
    limit = len(token_ids) - 1 if max_hit_tokens is None else max_hit_tokens
    matched = tree.match_prefix(token_ids, None, limit)
    matched = matched[:win.hit_length(matched)]
    num_new = _num_blocks_for(len(token_ids), BS) - len(matched)
    if not tree.can_allocate(num_new + win.num_new_blocks(num_new), matched):
        return None
    win.admit(seq_id, matched)
    shared = tree.add_sequence(seq_id, token_ids, max_shared_tokens=len(matched) * BS)
    assert shared == len(matched) * BS
    win.sync(seq_id)
    return shared


def grow(tree, win, seq_id, token_ids) -> bool:
    win.release_skipped(seq_id, tree.num_tokens(seq_id))
    num_new = (_num_blocks_for(tree.num_tokens(seq_id) + len(token_ids), BS)
               - len(tree.block_ids(seq_id)))
    if not tree.can_allocate(num_new + win.num_new_blocks(num_new)):
        return False
    assert tree.append(seq_id, token_ids) is not None
    win.sync(seq_id)
    return True


def release(tree, win, seq_id) -> None:
    win.release(seq_id)
    tree.release(seq_id)


def check_windows_live(tree, win) -> None:
    free = set(tree.free_block_ids)
    for seq_id in tree.seqs:
        first = win.skipped_chunks(tree.num_tokens(seq_id) - 1)   # the last token's window
        for row in win.block_ids(seq_id):
            assert len(row) == len(tree.block_ids(seq_id))
            for block in row[first:]:
                assert block != 0 and block not in free, (seq_id, row)


def vllm_hit(present: list[bool], window: int) -> int:
    """vLLM's sliding-window hit, read literally: the longest prefix of `end` chunks whose
    chunks from the next token's window start up to `end` all have blocks."""
    for end in range(len(present), 0, -1):
        start = max(0, end * BS - window + 1) // BS
        if all(present[start:end]):
            return end
    return 0


@pytest.mark.parametrize("window", [1, 4, 5, 6, 9, 13])
def test_hit_length_is_vllms_sliding_window_hit(window):
    rng = random.Random(window)
    for _ in range(300):
        tree, win = make(64, 1, window)
        n = rng.randrange(1, 10)
        prompt = [rng.randrange(1, 5) for _ in range(n * BS + 1)]
        admit(tree, win, "a", prompt)
        release(tree, win, "a")
        chunks = tree.match_prefix(prompt)
        present = [rng.random() < 0.7 for _ in chunks]
        for chunk, keep in zip(chunks, present):
            if not keep and chunk in win.bundles:
                win.on_evict(chunk)                 # as if reclaimed
        present = [c in win.bundles for c in chunks]
        assert win.hit_length(chunks) == vllm_hit(present, window), (present, window)


def test_a_window_lets_go_of_what_it_no_longer_reads_and_a_hit_takes_it_back():
    tree, win = make(64, 2, window=6)               # a token reads itself and 5 before
    prompt = list(range(1, 4 * BS + 3))             # 18 tokens: 4 chunks and a tail
    admit(tree, win, "a", prompt)
    assert win.block_ids("a")[0].count(0) == 0      # prefill: every position has blocks
    grow(tree, win, "a", [50])                      # the window of token 19 starts at 13
    assert [row[:3] for row in win.block_ids("a")] == [[0, 0, 0]] * 2
    assert len(win.cached) == 3 and win.num_reclaimable == 6
    tree.check_invariants()
    # A request sharing 3 chunks needs chunks 1..2 in its window (cdiv(5, 4) = 2): cached.
    assert admit(tree, win, "b", prompt[:3 * BS] + [77, 78]) == 3 * BS
    assert win.block_ids("b")[0][:3] == [0] + win.hit_block_ids(tree.seqs["b"].chunks)[0][1:]
    assert len(win.cached) == 1                     # chunk 0's blocks: not in b's window
    tree.check_invariants()
    release(tree, win, "b")
    release(tree, win, "a")
    assert tree.reset() and not win.bundles
    tree.check_invariants()


def test_released_window_blocks_are_reclaimed_before_chunks():
    tree, win = make(1 + 16, 1, window=5)
    admit(tree, win, "a", list(range(1, 6 * BS + 1)))   # 6 chunks: 12 blocks of 16
    grow(tree, win, "a", [99])
    release(tree, win, "a")
    reclaimable = tree.num_reclaimable_blocks
    assert reclaimable == 16 - len(tree.free_block_ids)
    # 14 new blocks: the 4 free ones, then cached window blocks, then chunks, leaf first.
    admit(tree, win, "b", list(range(500, 500 + 6 * BS + 1)))
    tree.check_invariants()
    assert tree.num_evictions < 6
    assert not win.cached                               # window blocks went first


def test_a_duplicates_window_blocks_go_to_its_listed_twin():
    tree, win = make(64, 1, window=5)
    prompt = list(range(1, 3 * BS + 2))
    admit(tree, win, "a", prompt)
    release(tree, win, "a")
    listed = tree.match_prefix(prompt)
    for chunk in listed:                                # window blocks reclaimed, chunks kept
        win.on_evict(chunk)
    assert win.hit_length(listed) == 0
    assert admit(tree, win, "b", prompt) == 0           # fills duplicates of the listed chunks
    release(tree, win, "b")
    assert win.hit_length(tree.match_prefix(prompt)) == 3
    assert admit(tree, win, "c", prompt) == 3 * BS
    tree.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_windows_live_and_books_balanced(seed):
    rng = random.Random(seed)
    tree, win = make(1 + rng.choice([24, 40, 80]), rng.choice([1, 2]), rng.choice([3, 6, 9]))
    system = [rng.randrange(1, 4) for _ in range(3 * BS)]
    live, next_id = [], 0
    for _ in range(400):
        op = rng.random()
        if op < 0.3 or not live:
            prompt = (system[:rng.randrange(0, len(system) + 1)]
                      + [rng.randrange(1, 4) for _ in range(rng.randrange(1, 3 * BS))])
            if admit(tree, win, next_id, prompt) is not None:
                live.append(next_id)
            next_id += 1
        elif op < 0.85:
            seq_id = rng.choice(live)
            if not grow(tree, win, seq_id, [rng.randrange(1, 4)
                                            for _ in range(rng.choice([1, 1, 1, 5]))]):
                live.remove(seq_id)                     # preempted
                release(tree, win, seq_id)
        else:
            seq_id = live.pop(rng.randrange(len(live)))
            release(tree, win, seq_id)
        tree.check_invariants()
        check_windows_live(tree, win)
    for seq_id in live:
        release(tree, win, seq_id)
    assert tree.stats().num_in_use_blocks == 0
    assert tree.reset()
