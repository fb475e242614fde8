"""The PyTorch reference TPP decode (the spec) against the fp64 per-sequence oracle, on random
trees; plus the numerics every kernel relies on: the merge, empty states, the LSE base."""
import math

import pytest
import torch

from vllm_chunkattn.ops import dense_decode_oracle, tpp_decode_reference
from vllm_chunkattn.ops.reference import empty_state, finish_state, merge_states
from vllm_chunkattn.plan import build_plan, empty_plan
from vllm_chunkattn.bench.tree_batches import TREE_SPECS, random_tree_batch
from vllm_chunkattn.kv_layout import KV_LAYOUTS

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def run_reference(b, plan=None):
    plan = plan or build_plan(b.block_table, b.seq_lens, b.block_size)
    return tpp_decode_reference(b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens,
                                plan, b.scale, return_lse=True)


def check_against_oracle(b, plan=None):
    out, lse = run_reference(b, plan)
    ref_out, ref_lse = dense_decode_oracle(b.query, b.key_cache, b.value_cache, b.block_table,
                                           b.seq_lens, b.scale)
    tol = TOL[b.query.dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("spec", list(TREE_SPECS))
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_named_specs_match_oracle(spec, layout):
    check_against_oracle(random_tree_batch(3, layout=layout, **TREE_SPECS[spec]))


@pytest.mark.parametrize("seed", range(12))
def test_random_trees_match_oracle(seed):
    g = torch.Generator().manual_seed(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    heads = pick([(8, 8), (8, 2), (8, 1), (9, 3)])
    b = random_tree_batch(seed, depth=pick([1, 2, 3, 4]), fanout=pick([1, 2, 4, 8]),
                          max_private_blocks=pick([0, 1, 3]), num_heads=heads[0],
                          num_kv_heads=heads[1], head_size=pick([64, 128, 256]),
                          block_size=pick([16, 64]), dtype=pick(list(TOL)),
                          layout=pick(KV_LAYOUTS), max_seqs=24)
    check_against_oracle(b)


def test_batch_order_invariance():
    b = random_tree_batch(5, **TREE_SPECS["deep_tree"])
    out, lse = run_reference(b)
    perm = torch.randperm(b.query.shape[0], generator=torch.Generator().manual_seed(1))
    b.query, b.block_table, b.seq_lens = b.query[perm], b.block_table[perm], b.seq_lens[perm]
    out_p, lse_p = run_reference(b)
    torch.testing.assert_close(out_p, out[perm], atol=0, rtol=0)   # bitwise: same grouping
    torch.testing.assert_close(lse_p, lse[perm], atol=0, rtol=0)


def test_empty_plan_is_plain_paged_decode():
    b = random_tree_batch(2, **TREE_SPECS["system_prompts"])
    check_against_oracle(b, empty_plan(b.query.shape[0]))


def test_merging_two_empty_states_stays_empty_not_nan():
    o, m, l = merge_states(empty_state(4, 8, "cpu"), empty_state(4, 8, "cpu"))
    assert torch.isneginf(m).all() and (l == 0).all() and (o == 0).all()


def test_lse_is_natural_log():
    # Two identical single-token states: the merged LSE rises by exactly ln 2 (base 2 would be 1).
    state = (torch.ones(1, 4), torch.tensor([0.5]), torch.tensor([1.0]))
    _, lse_one = finish_state(*state)
    _, lse_two = finish_state(*merge_states(state, state))
    assert torch.allclose(lse_two - lse_one, torch.tensor(math.log(2.0)))


def test_merge_is_associative_and_commutative():
    g = torch.Generator().manual_seed(0)
    states = [(torch.randn(3, 5, generator=g), torch.randn(3, generator=g),
               torch.rand(3, generator=g) + 0.5) for _ in range(3)]
    a, b, c = states
    left = finish_state(*merge_states(merge_states(a, b), c))
    right = finish_state(*merge_states(c, merge_states(b, a)))
    torch.testing.assert_close(left, right)
