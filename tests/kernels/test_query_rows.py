"""Verify rows (several query tokens per sequence, causal among them) through TPP as one row per
query token (plan/query_rows.py): the native CPU kernel and tpp_decode_reference against an fp64
causal attention over each sequence's contiguous K/V that knows nothing of rows, plans or pages.
The query tokens of a row end inside one partial tail block, or straddle a block boundary (the
block is full for some of them, a partial tail for the others), next to rows sharing chunks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_chunkattn.ops.native import native_ops
from vllm_chunkattn.ops.reference import tpp_decode_reference
from vllm_chunkattn.plan import PlanCache, build_plan, query_rows

OPS = native_ops(torch.device("cpu"))
BS, HEADS, KV_HEADS, HEAD_SIZE = 16, 8, 2, 64
SCALE = HEAD_SIZE ** -0.5

# (sequence, seq_len, query tokens): a and b share chunks 0-1, c shares chunk 0; a's four query
# tokens end inside its tail block (lengths 42..45), b's straddle the end of chunk 1 (31..34),
# d is a new three-token prompt inside one block (1..3), c a plain decode row.
SEQUENCES = (("a", 45, 4), ("b", 34, 4), ("c", 40, 1), ("d", 3, 3))
LOGICAL_BLOCKS = {"a": [0, 1, 2], "b": [0, 1, 3], "c": [0, 4, 5], "d": [6]}


def batch(seed: int, sequences=SEQUENCES):
    """Per sequence its contiguous K/V (the oracle's input) and the same KV in a paged cache
    whose blocks are permuted (block 0 left unused, as vLLM's null block)."""
    gen = torch.Generator().manual_seed(seed)
    num_logical = 7
    physical = 1 + torch.randperm(num_logical, generator=gen)          # logical -> physical id
    logical_kv = torch.randn(2, num_logical, BS, KV_HEADS, HEAD_SIZE, generator=gen)
    key_cache = torch.zeros(num_logical + 1, BS, KV_HEADS, HEAD_SIZE)
    value_cache = torch.zeros_like(key_cache)
    key_cache[physical], value_cache[physical] = logical_kv[0], logical_kv[1]
    width = max(len(b) for b in LOGICAL_BLOCKS.values())
    table, seq_lens, starts, contiguous = [], [], [0], []
    for name, seq_len, num_query in sequences:
        ids = [int(physical[b]) for b in LOGICAL_BLOCKS[name]]
        table.append(ids + [0] * (width - len(ids)))
        seq_lens.append(seq_len)
        starts.append(starts[-1] + num_query)
        kv = logical_kv[:, LOGICAL_BLOCKS[name]].flatten(1, 2)[:, :seq_len]
        contiguous.append(kv)
    query = torch.randn(starts[-1], HEADS, HEAD_SIZE, generator=gen)
    return (query, key_cache, value_cache, np.array(table, np.int32), np.array(seq_lens),
            np.array(starts), contiguous)


def causal_oracle(query, starts, contiguous, sliding_window: int = 0) -> torch.Tensor:
    """fp64: query token j of a sequence of L tokens with q query tokens, its last ones, sees
    keys [0, L - q + 1 + j) (within a window: its last sliding_window of those)."""
    outs = []
    group = HEADS // KV_HEADS
    for s, kv in enumerate(contiguous):
        k = kv[0].double().repeat_interleave(group, dim=1)           # [L, Hq, D]
        v = kv[1].double().repeat_interleave(group, dim=1)
        seq_len, num_query = k.shape[0], starts[s + 1] - starts[s]
        q = query[starts[s]:starts[s + 1]].double()                  # [q, Hq, D]
        scores = torch.einsum("qhd,thd->hqt", q, k) * SCALE
        key_pos = torch.arange(seq_len)[None, :]
        last_visible = (seq_len - num_query + torch.arange(num_query))[:, None]
        hidden = key_pos > last_visible
        if sliding_window:
            hidden |= key_pos <= last_visible - sliding_window
        scores = scores.masked_fill(hidden[None], float("-inf"))
        outs.append(torch.einsum("hqt,thd->qhd", torch.softmax(scores, dim=-1), v))
    return torch.cat(outs)


def run_native(plan, query, key_cache, value_cache, block_table, lens, sliding_window=0):
    slots = max(plan.num_partials, 1)
    ws = (torch.full((slots, HEADS, HEAD_SIZE), float("nan")),
          torch.full((slots, HEADS), float("nan")), torch.full((slots, HEADS), float("nan")))
    out = torch.full(query.shape, float("nan"))
    OPS.tpp_decode(query, key_cache, value_cache, block_table, lens, *plan.tensors(), *ws, SCALE,
                   out, None, sliding_window, 0.0, None, 1.0, 1.0)
    return out


def test_query_rows_are_each_tokens_causal_length():
    row_of_token, lens = query_rows(np.array([0, 4, 8, 9, 12]), np.array([45, 34, 40, 3]))
    assert row_of_token.tolist() == [0] * 4 + [1] * 4 + [2] + [3] * 3
    assert lens.tolist() == [42, 43, 44, 45, 31, 32, 33, 34, 40, 1, 2, 3]


@pytest.mark.parametrize("sliding_window", [0, 20])
@pytest.mark.parametrize("seed", [0, 1])
def test_verify_rows_through_tpp_match_causal_attention(seed, sliding_window):
    query, key_cache, value_cache, table, seq_lens, starts, contiguous = batch(seed)
    row_of_token, token_lens = query_rows(starts, seq_lens)
    block_table = torch.from_numpy(table[row_of_token])
    lens = torch.from_numpy(token_lens.astype(np.int32))
    plan = build_plan(block_table, lens, BS)
    # The query rows of a and b share chunks 0-1 with each other and c: read once for all.
    assert plan.num_nodes >= 2 and plan.num_partials >= 9
    want = causal_oracle(query, starts, contiguous, sliding_window).float()
    ref = tpp_decode_reference(query, key_cache, value_cache, block_table, lens, plan, SCALE,
                               sliding_window=sliding_window)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    if OPS is None:
        pytest.skip("vllm_chunkattn._C not built (python setup.py build_ext --inplace)")
    out = run_native(plan, query, key_cache, value_cache, block_table, lens, sliding_window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [0, 20])
def test_query_row_plan_from_the_request_rows_plan(sliding_window):
    """PlanCache with query_start_loc: the request rows planned on their first query tokens,
    expanded to query rows. Here (by hand): a's first token sees 42 tokens (2 full chunks), b's
    31 (1), c's 40 (2), d's 1 (0). Chunk 0 is shared by the 9 query tokens of a, b and c; a's
    chunk 1 is its own, read once for its 4 tokens; b's chunk 1 holds its drafts' KV, so each of
    its tokens walks it in its own tail."""
    query, key_cache, value_cache, table, seq_lens, starts, contiguous = batch(0)
    plans = PlanCache(BS)
    plan = plans.get(table, seq_lens, query_start_loc=starts)
    phys = {name: table[i].tolist() for i, (name, _, _) in enumerate(SEQUENCES)}
    assert plan.node_block_ids.tolist() == [phys["a"][0], phys["a"][1]]
    assert plan.node_seq_indptr.tolist() == [0, 9, 13]
    assert sorted(plan.node_seq_ids[:9].tolist()) == list(range(9))
    assert plan.node_seq_ids[9:].tolist() == [0, 1, 2, 3]
    assert plan.node_first_block.tolist() == [0, 1]
    assert plan.seq_num_shared_blocks.tolist() == [2] * 4 + [1] * 4 + [1] + [0] * 3
    row_of_token, token_lens = query_rows(starts, seq_lens)
    block_table = torch.from_numpy(table[row_of_token])
    lens = torch.from_numpy(token_lens.astype(np.int32))
    want = causal_oracle(query, starts, contiguous, sliding_window).float()
    ref = tpp_decode_reference(query, key_cache, value_cache, block_table, lens, plan, SCALE,
                               sliding_window=sliding_window)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    if OPS is None:
        pytest.skip("vllm_chunkattn._C not built (python setup.py build_ext --inplace)")
    out = run_native(plan, query, key_cache, value_cache, block_table, lens, sliding_window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# Steps of the same requests: b's drafts now lie in its own chunk 3 past the chunks 0-1 it shares
# with a. Then a accepted one draft and verifies 2, b accepted none and decodes one token, d
# verifies 2; then a step without drafts. No first query token gains a full chunk, so the plan
# of the request rows stays (a plan of query rows would be rebuilt: their number changes).
STEPS = ((("a", 45, 4), ("b", 36, 4), ("c", 40, 1), ("d", 3, 3)),
         (("a", 45, 2), ("b", 34, 1), ("c", 41, 1), ("d", 3, 2)),
         (("a", 46, 1), ("b", 35, 1), ("c", 42, 1), ("d", 4, 1)))


def test_the_request_rows_plan_is_reused_while_the_drafts_change():
    plans = PlanCache(BS)
    for sequences in STEPS:
        query, key_cache, value_cache, table, seq_lens, starts, contiguous = batch(0, sequences)   # the same pages
        multi = int(np.diff(starts).max()) > 1
        plan = plans.get(table, seq_lens, query_start_loc=starts if multi else None)
        row_of_token, token_lens = query_rows(starts, seq_lens)
        block_table = torch.from_numpy(table[row_of_token])
        lens = torch.from_numpy(token_lens.astype(np.int32))
        want = causal_oracle(query, starts, contiguous).float()
        got = (tpp_decode_reference(query, key_cache, value_cache, block_table, lens, plan, SCALE)
               if OPS is None else run_native(plan, query, key_cache, value_cache, block_table,
                                              lens))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert plan.num_seqs == len(row_of_token)
    assert (plans.num_builds, plans.num_reuses) == (1, 2)
