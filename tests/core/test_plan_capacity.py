"""Capacity mode (CUDA graphs): plans pruned to fit fixed capacities stay exact, padded plans give
the same attention, and PlanCache keeps one buffer whose tensors never move across trees."""
import pytest
import torch

from test_plan import decompose
from vllm_chunkattn.ops.reference import dense_decode_oracle, tpp_decode_reference
from vllm_chunkattn.plan import build_plan
from vllm_chunkattn.plan.cache import PlanCache
from vllm_chunkattn.plan.capacity import PARTIALS_PER_ROW, PlanCapacity, pad_plan
from vllm_chunkattn.plan import TppPlan
from vllm_chunkattn.bench.tree_batches import (TREE_SPECS, caterpillar_batch, pad_batch,
                                               random_tree_batch)

BS = 16


def assert_exact(b, plan):
    out, lse = tpp_decode_reference(b.query, b.key_cache, b.value_cache, b.block_table,
                                    b.seq_lens, plan, b.scale, return_lse=True)
    want, want_lse = dense_decode_oracle(b.query, b.key_cache, b.value_cache, b.block_table,
                                         b.seq_lens, b.scale)
    real = b.seq_lens > 0
    torch.testing.assert_close(out[real].double(), want[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[real].double(), want_lse[real], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))      # graph padding rows


def hand_tree():
    """S = blocks 1-4 shared by 4 rows; A = 10-12 by rows 0, 1; B = 13 by rows 2, 3. Savings
    (blocks read once instead of per row): S 3 * 4 = 12, A 1 * 3 = 3, B 1 * 1 = 1."""
    rows = [[1, 2, 3, 4, 10, 11, 12, 20], [1, 2, 3, 4, 10, 11, 12, 21],
            [1, 2, 3, 4, 13, 22, 0, 0], [1, 2, 3, 4, 13, 23, 0, 0]]
    lens = [7 * BS + 5, 7 * BS + 9, 5 * BS + 1, 5 * BS + 16]
    return torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def nodes_of(plan):
    nb, ids = plan.node_block_indptr.tolist(), plan.node_block_ids.tolist()
    ns, seqs = plan.node_seq_indptr.tolist(), plan.node_seq_ids.tolist()
    return [(ids[nb[n]:nb[n + 1]], sorted(seqs[ns[n]:ns[n + 1]])) for n in range(plan.num_nodes)]


@pytest.mark.parametrize("limits,want_nodes,want_shared", [
    (dict(), [([1, 2, 3, 4], [0, 1, 2, 3]), ([10, 11, 12], [0, 1]), ([13], [2, 3])],
     [7, 7, 5, 5]),
    (dict(max_partials=7), [([1, 2, 3, 4], [0, 1, 2, 3]), ([10, 11, 12], [0, 1])], [7, 7, 4, 4]),
    (dict(max_partials=5), [([1, 2, 3, 4], [0, 1, 2, 3])], [4, 4, 4, 4]),
    (dict(max_node_blocks=7), [([1, 2, 3, 4], [0, 1, 2, 3]), ([10, 11, 12], [0, 1])],
     [7, 7, 4, 4]),
    (dict(max_node_blocks=6), [([1, 2, 3, 4], [0, 1, 2, 3])], [4, 4, 4, 4]),
    (dict(max_partials=3), [], [0, 0, 0, 0]),
])
def test_pruning_leaves_the_least_saving_leaves_private(limits, want_nodes, want_shared):
    table, lens = hand_tree()
    plan = build_plan(table, lens, BS, **limits)
    assert nodes_of(plan) == want_nodes
    assert plan.seq_num_shared_blocks.tolist() == want_shared
    for i, (shared, private, first) in enumerate(decompose(plan, table, lens, BS)):
        assert shared + private == table[i, :-(-int(lens[i]) // BS)].tolist()


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("fraction", [0.75, 0.4, 0.0])
def test_pruned_plans_fit_and_stay_exact(seed, fraction):
    b = random_tree_batch(seed, **TREE_SPECS["deep_tree" if seed % 2 else "system_prompts"])
    full = build_plan(b.block_table, b.seq_lens, BS)
    max_partials = int(full.num_partials * fraction)
    max_blocks = int(full.num_shared_blocks * (1 - fraction / 2))
    plan = build_plan(b.block_table, b.seq_lens, BS, max_partials=max_partials,
                      max_node_blocks=max_blocks)
    assert plan.num_partials <= max_partials and plan.num_shared_blocks <= max_blocks
    for i, (shared, private, _) in enumerate(decompose(plan, b.block_table, b.seq_lens, BS)):
        assert shared + private == b.block_table[i, :-(-int(b.seq_lens[i]) // BS)].tolist()
    assert_exact(b, plan)


def test_capacity_plans_reuse_one_buffer_for_every_tree():
    # What a captured graph needs: the same tensors (address and shape) whatever the tree,
    # including one deeper than the capacity (pruned) and rows padded to the captured size.
    width = 12
    trees = [pad_batch(b, 12, width) for b in (
        random_tree_batch(1, **TREE_SPECS["system_prompts"], max_seqs=9), caterpillar_batch(10),
        random_tree_batch(5, **TREE_SPECS["deep_tree"], max_seqs=11))]
    cap = PlanCapacity.for_batch(12, width)
    assert cap == PlanCapacity(12, 11, 12 * PARTIALS_PER_ROW, 6 * width)
    assert build_plan(trees[1].block_table, trees[1].seq_lens, BS).num_partials > cap.num_partials
    cache = PlanCache(BS, "cpu", capacity=cap)
    pointers = None
    for b in trees:
        plan = cache.get(b.block_table, b.seq_lens)
        assert (plan.num_seqs, plan.num_nodes, plan.num_partials) == (12, 11, cap.num_partials)
        assert plan.node_block_ids.numel() == cap.num_node_blocks
        ptrs = [getattr(plan, f).data_ptr() for f in TppPlan.TENSORS]
        assert pointers is None or ptrs == pointers
        pointers = ptrs
        assert_exact(b, plan)
    assert cache.num_builds == 3 and cache._staging.capacity == cap.num_ints


def test_pad_plan_refuses_a_plan_that_does_not_fit():
    b = random_tree_batch(4, **TREE_SPECS["deep_tree"])
    plan = build_plan(b.block_table, b.seq_lens, BS)
    small = PlanCapacity(plan.num_seqs, plan.num_nodes, plan.num_partials - 1, 1 << 10)
    with pytest.raises(ValueError, match="does not fit"):
        pad_plan(plan, small)
    assert_exact(b, pad_plan(plan, PlanCapacity.for_batch(plan.num_seqs,
                                                          b.block_table.shape[1])))
