"""The bench's KV cache: one random cache per (heads, block) config, reused across a grid's points,
and the decode batch (Batch) a point reads from it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv_layout import alloc_kv_cache, kv_cache_views


@dataclass
class Batch:
    query: torch.Tensor
    kv_cache: torch.Tensor      # vLLM's logical [num_blocks, num_kv_heads, block_size, 2 * head_size]
    #                             (KvPool layout "paged_nhd": [num_blocks, 2, block, kv heads, head])
    key_cache: torch.Tensor     # our [num_blocks, block_size, num_kv_heads, head_size] views of it
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    scale: float


class KvPool:
    """One random KV cache per (heads, block) config, sized for the largest point and reused:
    filling GBs of cache per point would dominate the run."""

    def __init__(self, num_blocks, block_size, num_kv_heads, head_size, dtype, device, layout,
                 fp8_dtype: torch.dtype | None = None):
        """fp8_dtype (torch.float8_e4m3fn / float8_e5m2): an fp8 cache as vLLM allocates one
        (uint8, read through fp8 views), holding N(0, 1) values at k/v scales of 1."""
        self.dtype = dtype
        if fp8_dtype is not None:
            self.kv_cache = alloc_kv_cache(num_blocks, block_size, num_kv_heads, head_size,
                                           torch.uint8, device, layout)
            self.key_cache, self.value_cache = (v.view(fp8_dtype) for v in
                                                kv_cache_views(self.kv_cache, layout))
            for cache in (self.key_cache, self.value_cache):
                cache.copy_(torch.randn(cache.shape, device=device).to(fp8_dtype))
        elif layout == "paged_nhd":
            # FlashInfer's (and vLLM's FLASHINFER backend's) pages [blocks, 2, block, kv heads,
            # head]: our op reads the K and V halves in place, so both read the same bytes.
            self.kv_cache = torch.empty(num_blocks, 2, block_size, num_kv_heads, head_size,
                                        dtype=dtype, device=device)
            self.key_cache, self.value_cache = self.kv_cache[:, 0], self.kv_cache[:, 1]
        else:
            self.kv_cache = alloc_kv_cache(num_blocks, block_size, num_kv_heads, head_size,
                                           dtype, device, layout)
            self.key_cache, self.value_cache = kv_cache_views(self.kv_cache, layout)
        if fp8_dtype is None:
            self.kv_cache.normal_()
        self.block_size, self.head_size = block_size, head_size

    def batch(self, n_p, n_s, b, num_heads, seed) -> Batch:
        bs = self.block_size
        seq_len = n_p + 1
        shared = n_s // bs
        private = -(-seq_len // bs) - shared
        g = torch.Generator().manual_seed(seed)
        ids = torch.randperm(self.kv_cache.shape[0] - 1, generator=g)[:shared + b * private] + 1
        table = torch.cat([ids[:shared].expand(b, shared), ids[shared:].view(b, private)], dim=1)
        head_size = self.head_size
        dev = self.kv_cache.device
        query = torch.randn(b, num_heads, head_size, generator=g).to(self.dtype).to(dev)
        return Batch(query, self.kv_cache, self.key_cache, self.value_cache,
                     table.to(torch.int32).to(dev),
                     torch.full((b,), seq_len, dtype=torch.int32, device=dev), head_size ** -0.5)

    def from_table(self, block_table, seq_lens, num_heads, generator) -> Batch:
        """A batch over given host block table / seq_lens (kernel_trees.tree_block_table)."""
        head_size = self.head_size
        dev = self.kv_cache.device
        query = torch.randn(block_table.shape[0], num_heads, head_size, generator=generator)
        return Batch(query.to(self.dtype).to(dev), self.kv_cache, self.key_cache,
                     self.value_cache, block_table.to(torch.int32).to(dev),
                     seq_lens.to(torch.int32).to(dev), head_size ** -0.5)


# ---- the contenders: each returns a zero-argument callable writing into a preallocated output
