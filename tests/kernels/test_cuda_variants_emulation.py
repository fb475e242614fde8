"""The CUDA TPP kernel's attention variants (csrc/tpp_schema.h: sliding_window, soft_cap, sinks),
run on the CPU through the SIMT emulation (test_cuda_simt_emulation.py says what it checks), each
against the fp64 dense oracle, which knows nothing of plans. Windows are placed so that their
edges fall where the kernel treats them differently: inside a shared node (each sharer masks the
node from its own edge), wholly past a node (that sharer's partial is the empty state), inside a
private tail (the row's range starts at its edge), or inside one block. Small shapes: the
emulation is slow."""
from __future__ import annotations

import pytest
import torch

from vllm_chunkattn.bench.cuda_work import split_spare_slots, tpp_work
from vllm_chunkattn.bench.tree_batches import (TC_LSE_TOL, TC_TOL, padded_to_capacity, poison_unread_kv,
                                               random_tree_batch)
from vllm_chunkattn.ops.reference import dense_decode_oracle
from vllm_chunkattn.plan import PlanCapacity, build_plan

from test_cuda_simt_emulation import H100_RESIDENT_CTAS, run

SHARED = dict(fanouts=[2, 3], max_node_blocks=3, max_private_blocks=2)   # nodes at two depths
WIDE = dict(fanouts=[1, 8], max_node_blocks=3, max_private_blocks=1)     # one node, 8 sharers
LONG = dict(fanouts=[1, 4], max_node_blocks=12, max_private_blocks=8)    # several smem stages


def sinks_for(num_heads: int, seed: int = 0, spread: float = 2.0) -> torch.Tensor:
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * spread


def oracle(b, **variant):
    return dense_decode_oracle(b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens,
                               b.scale, **variant)


def check(b, out, lse, expect=None, **variant):
    """out / lse against the fp64 oracle (every element written: no NaN). expect: the oracle's
    results of the batch before its unread KV was poisoned (the oracle's masked weights still
    multiply their V rows)."""
    ref, ref_lse = expect or oracle(b, **variant)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), ref, **TC_TOL[b.query.dtype])
    torch.testing.assert_close(lse.double(), ref_lse, **TC_LSE_TOL[b.query.dtype])


def window_cases(b, plan, window: int) -> set[str]:
    """Where a window's edge falls, over the batch's rows: "in_node" (inside a shared node, not at
    its start), "past_node" (a node the row shares lies wholly before its window), "in_tail"
    (inside the row's private tail), "in_block" (the window is shorter than a block)."""
    bs, cases = b.block_size, set()
    lens = b.seq_lens.tolist()
    lo = [max(0, n - window) for n in lens]
    nb, first = plan.node_block_indptr.tolist(), plan.node_first_block.tolist()
    ns, ids = plan.node_seq_indptr.tolist(), plan.node_seq_ids.tolist()
    for n in range(plan.num_nodes):
        start, end = first[n] * bs, (first[n] + nb[n + 1] - nb[n]) * bs
        for i in ids[ns[n]:ns[n + 1]]:
            cases |= {"in_node"} if start < lo[i] < end else {"past_node"} if lo[i] >= end else set()
    for i, s in enumerate(plan.seq_num_shared_blocks.tolist()):
        if lo[i] > s * bs:
            cases.add("in_tail")
    if window < bs:
        cases.add("in_block")
    return cases


def variant_of(name: str, num_heads: int, window: int) -> dict:
    return {"window": dict(sliding_window=window), "soft_cap": dict(soft_cap=4.0),
            "sinks": dict(sinks=sinks_for(num_heads)),
            "all": dict(sliding_window=window, soft_cap=4.0, sinks=sinks_for(num_heads))}[name]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["window", "soft_cap", "sinks", "all"])
def test_each_variant_alone_and_together(emu, name, dtype):
    b = random_tree_batch(3, **SHARED, num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype)
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    variant = variant_of(name, 8, window=24)
    if "sliding_window" in variant:
        assert {"in_node", "past_node", "in_tail"} <= window_cases(b, plan, 24)
    check(b, *run(emu, b, plan, **variant), **variant)


@pytest.mark.parametrize("window", [1, 5, 16, 17])
def test_windows_of_a_block_or_less(emu, window):
    # 1: the row's own token alone; 5: inside one block; 16, 17: one block, the edge on or just
    # past a block boundary. Nodes then lie wholly before most rows' windows.
    b = random_tree_batch(2, **SHARED, num_heads=8, num_kv_heads=2, head_size=64,
                          dtype=torch.float16)
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    assert "past_node" in window_cases(b, plan, window)
    check(b, *run(emu, b, plan, sliding_window=window), sliding_window=window)


@pytest.mark.parametrize("forced", [(1, 1), (3, 2)])
def test_edges_across_a_nodes_stages_and_splits(emu, splits, forced):
    # A node of up to 12 blocks shared by 4 rows whose edges lie stages apart (the CTA starts at
    # the lowest, masks the rest per row), KV splits that lie wholly before some or all of the
    # rows' windows; every KV row outside every window is NaN, so none may be loaded.
    b = random_tree_batch(3, **LONG, num_heads=8, num_kv_heads=2, head_size=64,
                          dtype=torch.bfloat16)
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    window = 150
    assert {"in_node", "in_tail"} <= window_cases(b, plan, window)
    variant = dict(sliding_window=window, sinks=sinks_for(8, 1))
    expect = oracle(b, **variant)
    poison_unread_kv(b, window)
    splits(*forced)
    spare = split_spare_slots(plan, b.query.shape[0], *forced)
    check(b, *run(emu, b, plan, spare_slots=spare, **variant), expect)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_soft_cap_tames_peaky_scores(emu, dtype):
    # scale 2 at head 64: raw logits of tens, one token nearly all of a row's weight uncapped;
    # capped at 5 they stay within +-5, and the cap's tanh must run before max and exp.
    b = random_tree_batch(4, **SHARED, num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype)
    b.scale = 2.0
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    for cap in (5.0, 30.0):
        check(b, *run(emu, b, plan, soft_cap=cap), soft_cap=cap)


@pytest.mark.parametrize("heads", [(16, 2), (9, 3)])
def test_gqa_sharers_with_their_own_edges(emu, heads):
    # Group 8: chunk CTAs of 64 rows, 8 sharers x 8 q heads, each sharer its own edge inside the
    # node; group 3: 21 sharers' rows of a kv head in one CTA, 63 rows.
    b = random_tree_batch(5, **WIDE, num_heads=heads[0], num_kv_heads=heads[1], head_size=64,
                          dtype=torch.float16)
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    window = 30
    assert "in_node" in window_cases(b, plan, window)
    variant = dict(sliding_window=window, soft_cap=10.0, sinks=sinks_for(heads[0], 2))
    check(b, *run(emu, b, plan, **variant), **variant)


def test_sinks_of_empty_rows(emu):
    # Rows of seq_len 0 have an empty state and come out as 0 with lse = the sink; beside them,
    # sharers whose sinks of up to +-12 dominate their rows or vanish in them.
    b = random_tree_batch(6, **SHARED, num_heads=8, num_kv_heads=2, head_size=64,
                          dtype=torch.float16)
    b.seq_lens[0] = b.seq_lens[3] = 0
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    assert plan.num_nodes > 0
    sinks = sinks_for(8, 3, spread=6.0)
    out, lse = run(emu, b, plan, sinks=sinks)
    check(b, out, lse, sinks=sinks)
    empty = b.seq_lens == 0
    assert empty.any() and torch.equal(out[empty], torch.zeros_like(out[empty]))
    torch.testing.assert_close(lse[empty], sinks.expand_as(lse[empty]))   # via log2 and back


def test_a_padded_plan_with_a_window(emu):
    # A captured graph's plan (rows padded with seq_len 0, empty nodes; the CTAs choose the
    # chunk splits) under a window and sinks: the real rows as the oracle, padded rows 0 with
    # lse = the sink.
    b = random_tree_batch(7, max_seqs=10, fanouts=[3, 4], max_node_blocks=3, max_private_blocks=2,
                          num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16)
    n, rows, width = b.query.shape[0], 12, 12
    plan, cap = padded_to_capacity(b, rows, width), PlanCapacity.for_batch(rows, width)
    window = 50
    assert {"in_node", "past_node", "in_tail"} <= window_cases(b, plan, window)
    work = tpp_work(emu, rows, 8, 2, b.block_size, cap.num_nodes, plan.num_partials,
                    cap.num_node_blocks, width, plan.num_partials, H100_RESIDENT_CTAS, window)
    assert work["device_splits"] == 1
    sinks = sinks_for(8, 4)
    out, lse = run(emu, b, plan, sliding_window=window, sinks=sinks)
    check(b, out, lse, sliding_window=window, sinks=sinks)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    torch.testing.assert_close(lse[n:], sinks.expand_as(lse[n:]))   # via log2 and back


@pytest.mark.parametrize("stage", ["default", "compact"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_96(emu, monkeypatch, dtype, stage):
    # Phi-3's head size: 12 16-byte chunks a KV row, so a thread's copies move from chunk to chunk
    # (load_kv_stage); in 64- and 32-token stages of either launch, every variant on.
    tokens = "32" if stage == "compact" else "64"
    monkeypatch.setenv("CHUNKATTN_PARTIAL_STAGE_TOKENS", tokens)
    monkeypatch.setenv("CHUNKATTN_FINAL_STAGE_TOKENS", tokens)
    b = random_tree_batch(8, **SHARED, num_heads=8, num_kv_heads=2, head_size=96, dtype=dtype)
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    assert {"in_node", "past_node", "in_tail"} <= window_cases(b, plan, 40)
    variant = variant_of("all", 8, window=40)
    expect = oracle(b, **variant)
    poison_unread_kv(b, 40)
    check(b, *run(emu, b, plan, **variant), expect)
    assert emu.last_launch()[2] == 1024 + 64 * 104 * 2 + 2 * 2 * int(tokens) * 104 * 2


def test_a_window_bounds_the_tails_splits(emu):
    # Host work: a tail's splits come from the tokens a row can see, the window's at most.
    kw = dict(num_seqs=4, num_heads=8, num_kv_heads=2, block_size=16, num_nodes=0,
              num_partials=0, node_blocks=0, table_width=1024, slots=4 * 16,
              resident_ctas=H100_RESIDENT_CTAS)
    assert tpp_work(emu, **kw)["seq_splits"] > 1
    assert tpp_work(emu, **kw, sliding_window=512)["seq_splits"] == 1


@pytest.mark.parametrize("bad", [dict(sliding_window=-1), dict(soft_cap=-1.0),
                                 dict(soft_cap=float("inf")), dict(sinks=torch.zeros(7)),
                                 dict(sinks=torch.zeros(8, dtype=torch.float16))])
def test_refuses_a_variant_it_cannot_take(emu, bad):
    b = random_tree_batch(9, fanouts=[1], num_heads=8, num_kv_heads=2, head_size=64,
                          dtype=torch.float16)
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    with pytest.raises(RuntimeError, match="sliding_window|soft_cap|sinks"):
        run(emu, b, plan, **bad)
