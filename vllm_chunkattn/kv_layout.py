"""Views of a vLLM per-layer KV cache as key_cache / value_cache [num_blocks, block_size,
num_kv_heads, head_size] (strided, no copy), for the two layouts our kernels read in place.

vLLM 0.32 hands every layer a logical [num_blocks, num_kv_heads, block_size, 2 * head_size]
tensor; its physical strides depend on the backend's KVCacheLayout:
  "flash":    physical [B, N, H, K||V]   (LBNHC, FLASH_ATTN on GPU)
  "cpu_attn": physical [B, H, 2*N*D]     (LBHNC; CPU_ATTN vec/vec16 ISA writes K transposed
              [D, N] then V [N, D] inside each (block, head) slab)
  "cpu_attn_amx": the same slabs as CPU_ATTN's AMX ISA fills them (bf16): K in 16-token groups
              of [D/2][16] dim pairs, V in 16-dim groups of [N/2][16] token pairs, the B tiles of
              Q.K^T and P.V. Not expressible as one stride per logical dim: its views are 6-D
              ([B, N/16, 16, H, D/2, 2] and [B, N/2, 2, H, D/16, 16]); logical_cache flattens them.
"""
from __future__ import annotations

import torch

KV_LAYOUTS = ("flash", "cpu_attn", "cpu_attn_amx")
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
    if layout == "cpu_attn_amx":
        halves = kv_cache.view(num_blocks, num_kv_heads, 2, block_size * head_size)
        # word (t // 16) * 8D + (d // 2) * 16 + t % 16 holds dims (d, d + 1) of token t
        key = halves[:, :, 0].unflatten(-1, (block_size // 16, head_size // 2, 16, 2))
        # word (d // 16) * 8N + (t // 2) * 16 + d % 16 holds tokens (t, t + 1) of dim d
        value = halves[:, :, 1].unflatten(-1, (head_size // 16, block_size // 2, 16, 2))
        return key.permute(0, 2, 4, 1, 3, 5), value.permute(0, 3, 5, 1, 2, 4)
    raise ValueError(f"unknown KV layout {layout!r}; expected one of {KV_LAYOUTS}")


def alloc_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                   dtype: torch.dtype, device, layout: str) -> torch.Tensor:
    """A zeroed logical KV cache with the physical strides vLLM would give it."""
    if layout == "flash":
        return torch.zeros(num_blocks, block_size, num_kv_heads, 2 * head_size, dtype=dtype,
                           device=device).transpose(1, 2)
    if layout in ("cpu_attn", "cpu_attn_amx"):
        return torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size, dtype=dtype,
                           device=device)
    raise ValueError(f"unknown KV layout {layout!r}; expected one of {KV_LAYOUTS}")


def logical_cache(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, num_kv_heads, head_size] of a key or value view: the view itself,
    or for the 6-D "cpu_attn_amx" views a copy in that order."""
    return cache if cache.dim() == 4 else cache.flatten(1, 2).flatten(-2, -1)


def block_size_of(cache: torch.Tensor) -> int:
    """The block size of a key or value view in any layout."""
    return cache.shape[1] if cache.dim() == 4 else cache.shape[1] * cache.shape[2]


def write_logical(view: torch.Tensor, values: torch.Tensor) -> None:
    """view[...] = values, values as [num_blocks, block_size, num_kv_heads, head_size] whatever
    the view's layout."""
    if view.dim() == 6:
        values = values.unflatten(1, view.shape[1:3]).unflatten(-1, view.shape[4:6])
    view.copy_(values)
