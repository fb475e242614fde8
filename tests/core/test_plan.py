"""build_plan: the sharing tree of a decode batch, checked against a brute force over the block
table; PlanCache rebuilds exactly when the sharing structure can have changed."""
import numpy as np
import pytest
import torch

from vllm_chunkattn.plan import build_plan, lexicographic_order
from vllm_chunkattn.plan.cache import PlanCache
from vllm_chunkattn.plan.capacity import PlanCapacity, pad_plan
from vllm_chunkattn.bench.tree_batches import TREE_SPECS, random_tree_batch


def decompose(plan, block_table, seq_lens, block_size):
    """Per row: the block ids it reads through shared nodes (in order) and privately."""
    nb, nbi = plan.node_block_indptr.tolist(), plan.node_block_ids.tolist()
    ns, nsi = plan.node_seq_indptr.tolist(), plan.node_seq_ids.tolist()
    sp, spi = plan.seq_partial_indptr.tolist(), plan.seq_partial_ids.tolist()
    node_of_partial = np.repeat(np.arange(plan.num_nodes), np.diff(ns))
    rows = []
    for i in range(plan.num_seqs):
        shared = []
        for p in spi[sp[i]:sp[i + 1]]:
            assert nsi[p] == i, "a row's partial must belong to that row"
            n = node_of_partial[p]
            shared += nbi[nb[n]:nb[n + 1]]
        first = int(plan.seq_num_shared_blocks[i])
        nblk = -(-int(seq_lens[i]) // block_size)
        rows.append((shared, block_table[i, first:nblk].tolist(), first))
    return rows


@pytest.mark.parametrize("seed", range(20))
def test_plan_partitions_every_row_exactly(seed):
    spec = list(TREE_SPECS.values())[seed % len(TREE_SPECS)]
    b = random_tree_batch(seed, **spec)
    bt, sl, bs = b.block_table, b.seq_lens, b.block_size
    plan = build_plan(bt, sl, bs)
    for i, (shared, private, first) in enumerate(decompose(plan, bt, sl, bs)):
        nblk = -(-int(sl[i]) // bs)
        assert shared == bt[i, :first].tolist(), "shared nodes = the row's leading blocks"
        assert shared + private == bt[i, :nblk].tolist()
        assert first <= int(sl[i]) // bs, "only full blocks are shared"
    # Every node is seen by >= 2 rows that all hold its blocks; maximal: a row's first private
    # block is not held at the same column by any other row with the same prefix.
    ns = plan.node_seq_indptr.tolist()
    assert all(ns[n + 1] - ns[n] >= 2 for n in range(plan.num_nodes))
    full = (sl // bs).tolist()
    for i in range(plan.num_seqs):
        first = int(plan.seq_num_shared_blocks[i])
        if first < full[i]:
            twins = [j for j in range(plan.num_seqs) if j != i and full[j] > first
                     and bt[j, :first + 1].tolist() == bt[i, :first + 1].tolist()]
            assert not twins, f"row {i}: block column {first} is shared but was left private"


@pytest.mark.parametrize("seed", range(5))
def test_lexicographic_order_is_numpys_lexsort(seed):
    # The one-sort row order the plan uses, against numpy's column-by-column lexsort: negative,
    # extreme and repeated ids, repeated rows (a stable order keeps them in row order).
    rng = np.random.default_rng(seed)
    for _ in range(200):
        n, width = int(rng.integers(1, 30)), int(rng.integers(1, 12))
        high = int(rng.choice([2, 7, 2**31 - 1]))
        rows = rng.integers(-high, high, size=(n, width), endpoint=True).astype(np.int32)
        rows[rng.integers(0, n, size=n // 2)] = rows[0]
        rows[rng.integers(0, n), rng.integers(0, width)] = np.iinfo(np.int32).min
        assert np.array_equal(lexicographic_order(rows), np.lexsort(rows.T[::-1]))


def test_single_prefix_is_one_node_with_all_rows():
    b = random_tree_batch(0, **TREE_SPECS["single_prefix"])
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    assert plan.num_nodes == 1
    assert sorted(plan.node_seq_ids.tolist()) == list(range(b.query.shape[0]))


def test_no_sharing_gives_empty_plan():
    b = random_tree_batch(0, **TREE_SPECS["no_sharing"])
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    assert plan.num_nodes == 0 and plan.num_partials == 0
    assert (plan.seq_num_shared_blocks == 0).all()


def test_plan_cache_rebuilds_only_when_full_blocks_change():
    bs = 16
    bt = torch.tensor([[1, 2, 3, 0], [1, 2, 4, 0]], dtype=torch.int32)
    cache = PlanCache(bs)
    p1 = cache.get(bt, torch.tensor([40, 35]))
    p2 = cache.get(bt, torch.tensor([41, 36]))          # tails grow inside their blocks
    assert p2 is p1 and cache.num_builds == 1
    bt2 = bt.clone()
    bt2[0, 3] = 7
    p3 = cache.get(bt2, torch.tensor([48, 37]))         # row 0 fills block 3: structure moves
    assert p3 is not p1 and cache.num_builds == 2
    p4 = cache.get(bt2[[1, 0]], torch.tensor([37, 48]))  # batch reordered
    assert p4 is not p3 and cache.num_builds == 3
    assert int(p1.seq_num_shared_blocks[0]) == 2


def test_plan_cache_keeps_the_plan_while_rows_grow_past_a_private_full_block():
    bs = 16
    bt = torch.tensor([[1, 2, 3, 8, 0], [1, 2, 4, 0, 0], [1, 5, 0, 0, 0]], dtype=torch.int32)
    cache = PlanCache(bs)
    p1 = cache.get(bt, torch.tensor([49, 40, 20]))     # full blocks: [1 2 3], [1 2], [1]
    bt2 = bt.clone()
    bt2[0, 4] = 9
    # Row 0 fills block 8 (after its private block 3), row 1 its block 4 (after shared [1 2]):
    # row 1's new block might have been shared, so that step rebuilds.
    p2 = cache.get(bt2, torch.tensor([65, 40, 20]))
    assert p2 is p1 and cache.num_builds == 1 and cache.num_reuses == 1
    p3 = cache.get(bt2, torch.tensor([65, 49, 20]))
    assert p3 is not p1 and cache.num_builds == 2
    # Row 2 fills block 5 after shared [1]: rebuild; a row whose count falls: rebuild.
    assert cache.get(bt2, torch.tensor([65, 49, 33])) is not p3 and cache.num_builds == 3
    assert cache.get(bt2, torch.tensor([48, 49, 33])) is not None and cache.num_builds == 4


@pytest.mark.parametrize("capacity", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_plan_cache_returns_build_plans_plan_every_step(seed, capacity):
    # A decode run with rows that grow, fill blocks that are new or copy another row's block in
    # the same column (so new sharing appears), get replaced and reordered: every step the cached
    # plan is build_plan's for that step's table, reused or not, up to the order of a node's rows
    # (a rebuild sorts them by their private blocks too; the kernel's result does not depend on it).
    # capacity: plans pruned to a CUDA graph's small capacities (2 partials a row, 6 node blocks)
    # and padded to them, against build_plan's pruned plan padded the same way.
    def tree(plan):
        nb, nbi = plan.node_block_indptr.tolist(), plan.node_block_ids.tolist()
        ns, nsi = plan.node_seq_indptr.tolist(), plan.node_seq_ids.tolist()
        node_of_partial = np.repeat(np.arange(plan.num_nodes), np.diff(ns)).tolist()
        sp, spi = plan.seq_partial_indptr.tolist(), plan.seq_partial_ids.tolist()
        nodes = [(nbi[nb[n]:nb[n + 1]], sorted(nsi[ns[n]:ns[n + 1]])) for n in range(plan.num_nodes)]
        row_nodes = [[node_of_partial[p] for p in spi[sp[i]:sp[i + 1]]] for i in range(plan.num_seqs)]
        assert all(nsi[p] == i for i in range(plan.num_seqs) for p in spi[sp[i]:sp[i + 1]])
        return nodes, row_nodes, plan.seq_num_shared_blocks.tolist()

    rng = np.random.default_rng(seed)
    bs, rows, width = 4, 6, 10
    table = rng.integers(1, 8, size=(rows, width)).astype(np.int32)
    lens = rng.integers(1, 3 * bs, size=rows)
    table[:, 1:] = table[:, :1]                      # a common start makes sharing likely
    next_id = 100
    cap = PlanCapacity(rows, rows - 1, 2 * rows, 6) if capacity else None
    cache = PlanCache(bs, capacity=cap)

    def want():
        if cap is None:
            return build_plan(table, lens, bs)
        return pad_plan(build_plan(table, lens, bs, max_partials=cap.num_partials,
                                   max_node_blocks=cap.num_node_blocks), cap)
    for step in range(300):
        assert tree(cache.get(table, lens)) == tree(want()), step
        event = rng.random()
        if event < 0.05:                             # a row finishes, another takes its slot
            i = rng.integers(rows)
            lens[i] = rng.integers(1, width * bs // 2)
            table[i] = table[rng.integers(rows)]
        elif event < 0.08:
            perm = rng.permutation(rows)
            table, lens = table[perm].copy(), lens[perm].copy()
        for i in range(rows):
            if lens[i] < width * bs and rng.random() < 0.5:
                lens[i] += 1
                if (lens[i] - 1) % bs == 0:          # a new block: fresh, or another row's
                    col = (lens[i] - 1) // bs
                    j = rng.integers(rows)
                    table[i, col] = table[j, col] if rng.random() < 0.3 else next_id
                    next_id += 1
    assert cache.num_reuses > 50 and cache.num_builds > 20


def test_plan_cache_with_nothing_shared_keys_on_the_row_count():
    # Nothing shared, the plan is the empty one whatever the block ids: the cache keeps it while
    # the row count holds (every step a row fills a block), and rebuilds once rows share.
    bt = torch.arange(1, 13, dtype=torch.int32).view(4, 3)
    lens = torch.full((4,), 40)
    cache = PlanCache(16)
    p1 = cache.get(bt, lens)
    assert p1.num_nodes == 0 and p1.num_seqs == 4
    assert cache.get(bt + 100, lens + 9) is p1 and cache.num_builds == 1     # new blocks filled
    shared = (bt + 100).clone()
    shared[1, :2] = shared[0, :2]
    p3 = cache.get(shared, lens)
    assert p3.num_nodes == 1 and cache.num_builds == 2
    p4 = cache.get(bt[:3], lens[:3])
    assert p4.num_nodes == 0 and p4.num_seqs == 3 and cache.num_builds == 3


def test_staging_packs_plans_into_one_persistent_buffer():
    # plan_staging.PlanStaging, on CPU (no pinning, no events): every upload reproduces the plan
    # as views of one buffer, which grows when a plan outgrows it and is otherwise reused.
    from vllm_chunkattn.plan import PlanStaging, TppPlan
    staging = PlanStaging("cpu", capacity=8)
    for seed, spec in enumerate(["system_prompts", "deep_tree", "no_sharing", "deep_tree"]):
        b = random_tree_batch(seed, **TREE_SPECS[spec])
        plan = build_plan(b.block_table, b.seq_lens, b.block_size)
        up = staging.upload(plan)
        assert (up.num_seqs, up.num_nodes, up.num_partials) == (
            plan.num_seqs, plan.num_nodes, plan.num_partials)
        for f in TppPlan.TENSORS:
            assert torch.equal(getattr(up, f), getattr(plan, f)), f
            assert getattr(up, f).untyped_storage().data_ptr() == \
                staging._dev.untyped_storage().data_ptr()
    assert staging.capacity >= 64 and staging.num_uploads == 4
