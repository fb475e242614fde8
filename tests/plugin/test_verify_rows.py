"""ChunkAttnMetadataBuilder with speculative decoding: verify rows (1 + num_speculative_tokens
query tokens) count as decodes and reach TPP as one row per query token, each with its own
causal length; without speculation a multi-token row stays a prefill row. The impl's output for
the verify tokens is checked against an fp64 causal attention over the rows' KV."""
import numpy as np
import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import (CacheConfig, ModelConfig, ParallelConfig, SpeculativeConfig,
                         VllmConfig, set_current_vllm_config)
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_chunkattn.kv_layout import alloc_kv_cache, kv_cache_views
from vllm_chunkattn.plugin import backend
from vllm_runs import tiny_model

pytestmark = pytest.mark.vllm
BS, HEADS, KV_HEADS, HEAD_SIZE, NUM_SPEC = 32, 8, 2, 64, 3


def config(speculative: bool) -> VllmConfig:
    model = ModelConfig(model=str(tiny_model()), dtype="float32")
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=NUM_SPEC,
                             prompt_lookup_max=3, prompt_lookup_min=2,
                             target_model_config=model,
                             target_parallel_config=ParallelConfig()) if speculative else None
    return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BS),
                      speculative_config=spec)


def build(vllm_config, query_lens, seq_lens, table):
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.float32)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    num_tokens = int(qsl[-1])
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=lens, num_reqs=len(seq_lens),
        num_actual_tokens=num_tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        seq_lens_cpu_upper_bound=lens.clone())
    with set_current_vllm_config(vllm_config):
        builder = backend.ChunkAttnMetadataBuilder(spec, ["layer.0"], vllm_config,
                                                   torch.device("cpu"))
        return builder, builder.build(0, cm)


# A verify row whose 4 query tokens straddle the end of block 2 (lengths 63..66), a decode row
# sharing blocks 1-2 with it, then a 10-token prefill.
QUERY_LENS, SEQ_LENS = [1 + NUM_SPEC, 1, 10], [2 * BS + 2, 2 * BS + 9, 10]
TABLE = [[1, 2, 3], [1, 2, 4], [5, 0, 0]]


def test_verify_rows_are_decodes_with_one_tpp_row_per_query_token():
    builder, md = build(config(True), QUERY_LENS, SEQ_LENS, TABLE)
    assert builder.reorder_batch_threshold == 1 + NUM_SPEC
    assert (md.num_decodes, md.num_decode_tokens) == (2, 5) and md.prefill is not None
    assert md.decode_seq_lens.tolist() == [2 * BS - 1, 2 * BS, 2 * BS + 1, 2 * BS + 2,
                                           2 * BS + 9]
    assert md.decode_block_table.tolist() == [TABLE[0]] * 4 + [TABLE[1]]
    # Planned on each row's first query token (plan/query_rows.py): the verify row's first
    # token sees 63 tokens, one full block, which all five query tokens share; the blocks the
    # drafts fill are each token's own tail.
    want = {"node_block_ids": [1], "node_seq_ids": [0, 1, 2, 3, 4],
            "seq_num_shared_blocks": [1] * 5, "node_first_block": [0]}
    assert {name: getattr(md.plan, name).tolist() for name in want} == want


def test_without_speculation_a_multi_token_row_is_a_prefill():
    builder, md = build(config(False), QUERY_LENS, SEQ_LENS, TABLE)
    assert builder.reorder_batch_threshold == 1
    assert (md.num_decodes, md.num_decode_tokens) == (0, 0)


def test_the_verify_tokens_outputs_are_causal_attention():
    """Decode rows only (a verify row and a decode row sharing its chunks): the impl writes
    each query token's attention over the KV up to its own position."""
    query_lens, seq_lens, table = QUERY_LENS[:2], SEQ_LENS[:2], TABLE[:2]
    _, md = build(config(True), query_lens, seq_lens, table)
    gen = torch.Generator().manual_seed(0)
    kv_cache = alloc_kv_cache(6, BS, KV_HEADS, HEAD_SIZE, torch.float32, "cpu", "cpu_attn")
    key_cache, value_cache = kv_cache_views(kv_cache, "cpu_attn")
    key_cache.copy_(torch.randn(key_cache.shape, generator=gen))
    value_cache.copy_(torch.randn(value_cache.shape, generator=gen))
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, HEADS, HEAD_SIZE, generator=gen)
    scale = HEAD_SIZE ** -0.5
    with set_current_vllm_config(config(True)):
        impl = backend.ChunkAttnImpl(HEADS, HEAD_SIZE, scale, KV_HEADS, None, None, "auto")
    out = torch.full_like(query, float("nan"))
    kv_unused = torch.zeros(num_tokens, KV_HEADS, HEAD_SIZE)
    impl.forward(None, query, kv_unused, kv_unused, kv_cache, md, out)
    token = 0
    for row, (q, seq_len) in enumerate(zip(query_lens, seq_lens)):
        ids = torch.tensor(table[row])
        k = key_cache[ids].flatten(0, 1)[:seq_len].double().repeat_interleave(4, dim=1)
        v = value_cache[ids].flatten(0, 1)[:seq_len].double().repeat_interleave(4, dim=1)
        for j in range(q):
            visible = seq_len - q + 1 + j
            s = torch.einsum("hd,thd->ht", query[token].double(), k[:visible]) * scale
            want = torch.einsum("ht,thd->hd", torch.softmax(s, dim=-1), v[:visible])
            torch.testing.assert_close(out[token].double(), want, atol=1e-5, rtol=1e-5)
            token += 1
