"""The CUDA TPP kernel's attention variants (sliding_window, soft_cap, sinks) on a GPU, against
the fp64 dense oracle: the cases test_cuda_variants_emulation.py runs through the SIMT emulation,
at every head size, and a CUDA graph replaying a padded plan under a window. Skipped without a
CUDA GPU."""
from __future__ import annotations

import pytest
import torch

from vllm_chunkattn.bench.cuda_work import split_spare_slots
from vllm_chunkattn.bench.tree_batches import poison_unread_kv, random_tree_batch
from vllm_chunkattn.plan import build_plan

from test_cuda_variants_emulation import LONG, SHARED, WIDE, check, oracle, sinks_for, window_cases
from test_ops_cuda import ops, replay_padded_plan, run  # noqa: F401  (ops: a fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def variant(window=0, soft_cap=0.0, num_heads=0, seed=0):
    v = dict(sliding_window=window, soft_cap=soft_cap)
    if num_heads:
        v["sinks"] = sinks_for(num_heads, seed).cuda()
    return v


VARIANTS = {"window": dict(window=40), "soft_cap": dict(soft_cap=4.0), "sinks": dict(num_heads=8),
            "all": dict(window=40, soft_cap=4.0, num_heads=8), "tiny_window": dict(window=5)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants(ops, name, head_size, dtype):
    b = random_tree_batch(3, **SHARED, num_heads=8, num_kv_heads=2, head_size=head_size,
                          dtype=dtype, device="cuda")
    plan = build_plan(b.block_table.cpu(), b.seq_lens.cpu(), b.block_size).to("cuda")
    v = variant(**VARIANTS[name])
    expect = oracle(b, **v)
    poison_unread_kv(b, v["sliding_window"])
    check(b, *run(ops, b, plan, **v), expect)


@pytest.mark.parametrize("forced", [(1, 1), (3, 2), (16, 4)])
@pytest.mark.parametrize("spec,heads", [("long", (8, 2)), ("wide", (16, 2)), ("wide", (9, 3))])
def test_edges_across_stages_splits_and_sharers(ops, splits, spec, heads, forced):
    b = random_tree_batch(3 if spec == "long" else 5, **(LONG if spec == "long" else WIDE),
                          num_heads=heads[0], num_kv_heads=heads[1], head_size=128,
                          dtype=torch.bfloat16, device="cuda")
    plan = build_plan(b.block_table.cpu(), b.seq_lens.cpu(), b.block_size)
    window = 150 if spec == "long" else 30
    assert "in_node" in window_cases(b, plan, window)
    v = variant(window, 10.0, heads[0], 1)
    expect = oracle(b, **v)
    poison_unread_kv(b, window)
    splits(*forced)
    spare = split_spare_slots(plan, b.query.shape[0], *forced)
    check(b, *run(ops, b, plan.to("cuda"), spare_slots=spare, **v), expect)


def test_cuda_graph_replays_a_padded_plan_under_a_window(ops):
    b = random_tree_batch(7, max_seqs=10, fanouts=[3, 4], max_node_blocks=3, max_private_blocks=2,
                          num_heads=16, num_kv_heads=4, head_size=128, dtype=torch.float16,
                          device="cuda")
    n = b.query.shape[0]
    v = variant(50, 0.0, 16, 4)
    out, lse = replay_padded_plan(ops, b, 12, **v)
    check(b, out, lse, **v)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
