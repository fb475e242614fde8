"""ChunkPrefixTree.check_invariants: every count and link of the tree recounted from scratch."""
from __future__ import annotations

from .tree import PENDING, Chunk, ChunkPrefixTree, chunk_namespace


def check_invariants(tree: ChunkPrefixTree) -> None:
    """Assert that ref counts, listed flags, the eviction set, the pool's free / in use / cached
    split and the shared-token count match what the live sequences hold (O(tree))."""
    expected_refs: dict[Chunk, int] = {}
    owners: dict[int, object] = {}

    def claim(block_id: int, owner: object) -> None:
        assert 0 <= block_id < tree.num_blocks and block_id not in tree.reserved, block_id
        assert block_id not in owners, f"block {block_id} held by {owners[block_id]} and {owner}"
        owners[block_id] = owner

    for seq_id, seq in tree.seqs.items():
        parent = tree.root
        for index, chunk in enumerate(seq.chunks):
            assert chunk.parent is parent, f"{seq_id}: chunk {chunk.block_id} off its parent"
            assert chunk.depth == index, f"{seq_id}: chunk {chunk.block_id} depth"
            assert len(chunk.token_ids) == tree.block_size
            assert chunk.namespace == chunk_namespace(seq.namespace, index, tree.block_size)
            expected_refs[chunk] = expected_refs.get(chunk, 0) + 1
            parent = chunk
        assert len(seq.tail_token_ids) < tree.block_size
        tokens = [t for chunk in seq.chunks for t in chunk.token_ids] + seq.tail_token_ids
        known = len(tokens) - seq.num_pending
        assert PENDING not in tokens[:known] and tokens[known:] == [PENDING] * seq.num_pending
        assert (seq.tail_block_id is None) == (not seq.tail_token_ids), seq_id
        if seq.tail_block_id is not None:
            claim(seq.tail_block_id, ("tail", seq_id))
    listed, stack = [], [tree.root]
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            assert child.parent is node and child.key == key and child.listed, "misfiled chunk"
            listed.append(child)
            stack.append(child)
    listed_set = set(listed)
    for chunk in listed_set | set(expected_refs):
        assert chunk.ref_count == expected_refs.get(chunk, 0), f"chunk {chunk.block_id} ref_count"
        assert chunk.listed == (chunk in listed_set), f"chunk {chunk.block_id} listed flag"
        assert chunk.listed or chunk.ref_count > 0, f"unlisted chunk {chunk.block_id} not freed"
        assert not (chunk.listed and PENDING in chunk.token_ids), "pending token listed"
        claim(chunk.block_id, chunk)
    cached = [chunk for chunk in listed if chunk.ref_count == 0]
    assert tree.num_cached_blocks == len(cached)
    assert set(tree._evictable) == {chunk for chunk in cached if not chunk.children}
    for block_id in tree.free_block_ids:
        claim(block_id, "free")
    if tree.aux is not None:
        for block_id, owner in tree.aux.owned_blocks():
            claim(block_id, owner)
        tree.aux.check_invariants()
    assert len(owners) == tree.pool_size, "free + in_use + cached != pool"
    assert tree.num_shared_tokens == tree.block_size * sum(n - 1 for n in expected_refs.values())
