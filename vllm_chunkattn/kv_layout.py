"""Views of a vLLM per-layer KV cache as key_cache / value_cache [num_blocks, block_size,
num_kv_heads, head_size] (strided, no copy), for the two layouts our kernels read in place.

vLLM 0.32 hands every layer a logical [num_blocks, num_kv_heads, block_size, 2 * head_size]
tensor; its physical strides depend on the backend's KVCacheLayout:
  "flash":    physical [B, N, H, K||V]   (LBNHC, FLASH_ATTN on GPU)
  "cpu_attn": physical [B, H, 2*N*D]     (LBHNC; CPU_ATTN vec/vec16 ISA writes K transposed
              [D, N] then V [N, D] inside each (block, head) slab)
"""
from __future__ import annotations

import torch

KV_LAYOUTS = ("flash", "cpu_attn")
# vLLM's fp8 --kv-cache-dtype names -> the dtype of the views an fp8 cache (allocated as uint8)
# is read through; "fp8" is e4m3.
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                       "fp8_e5m2": torch.float8_e5m2}


def kv_cache_views(kv_cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_cache: vLLM's logical [num_blocks, num_kv_heads, block_size, 2 * head_size] view."""
    num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
    head_size = two_d // 2
    if layout == "flash":
        token_major = kv_cache.transpose(1, 2)
        return token_major[..., :head_size], token_major[..., head_size:]
    if layout == "cpu_attn":
        halves = kv_cache.view(num_blocks, num_kv_heads, 2, block_size * head_size)
        key = halves[:, :, 0].unflatten(-1, (head_size, block_size)).permute(0, 3, 1, 2)
        value = halves[:, :, 1].unflatten(-1, (block_size, head_size)).transpose(1, 2)
        return key, value
    raise ValueError(f"unknown KV layout {layout!r}; expected one of {KV_LAYOUTS}")


def alloc_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                   dtype: torch.dtype, device, layout: str) -> torch.Tensor:
    """A zeroed logical KV cache with the physical strides vLLM would give it."""
    if layout == "flash":
        return torch.zeros(num_blocks, block_size, num_kv_heads, 2 * head_size, dtype=dtype,
                           device=device).transpose(1, 2)
    if layout == "cpu_attn":
        return torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size, dtype=dtype,
                           device=device)
    raise ValueError(f"unknown KV layout {layout!r}; expected one of {KV_LAYOUTS}")
