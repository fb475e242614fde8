"""The HBM roofline and the tensor-core peak that the GPU kernel grid reports against. The device
ceilings are measured once per run.

unique KV bytes: every KV token the batch holds, counted once whatever number of rows read it.
  This is the sum over the distinct blocks of the block table of the tokens used in each block
  (P + B*S for one prefix P shared by B rows with S private tokens each), times
  2 (K and V) * num_kv_heads * head_size * dtype bytes. Queries and outputs are left out: a
  decode step reads 1 token per row of them.
roofline time = unique KV bytes / measured HBM bandwidth; % roofline = roofline time / measured.
chunk-first FLOPs: the work of the shared nodes, 4 * sharers * tokens * num_heads * head_size
  summed over the nodes (QK^T and PV, 2 FLOPs per multiply-add each). The sharers' q heads of
  one kv head are the rows of one GEMM, so a node is compute-bound once its rows per kv head
  (sharers * num_heads / num_kv_heads) pass the device's ridge point.
"""
from __future__ import annotations

import numpy as np
import torch

from ..plan import TppPlan
from .timing import Timer


def unique_kv_tokens(block_table, seq_lens, block_size: int) -> int:
    """Distinct KV tokens the batch holds: for each distinct block id, the most tokens any row
    uses of it (a shared block is full; a row's last block holds its tail)."""
    table = np.asarray(block_table.cpu() if isinstance(block_table, torch.Tensor) else block_table)
    lens = np.asarray(seq_lens.cpu() if isinstance(seq_lens, torch.Tensor) else seq_lens)
    used: dict[int, int] = {}
    for row, n in zip(table, lens):
        for col in range(-(-int(n) // block_size)):
            tokens = min(block_size, int(n) - col * block_size)
            block = int(row[col])
            used[block] = max(used.get(block, 0), tokens)
    return sum(used.values())


def kv_bytes_per_token(num_kv_heads: int, head_size: int, dtype: torch.dtype) -> int:
    """K and V of one token in one layer."""
    return 2 * num_kv_heads * head_size * torch.empty(0, dtype=dtype).element_size()


def roofline_us(unique_bytes: float, bandwidth_gbs: float) -> float:
    return unique_bytes / (bandwidth_gbs * 1e9) * 1e6


def chunk_first_flops(plan: TppPlan, num_heads: int, head_size: int, block_size: int) -> float:
    blocks = np.diff(plan.node_block_indptr.cpu().numpy()).astype(np.float64)
    sharers = np.diff(plan.node_seq_indptr.cpu().numpy()).astype(np.float64)
    return float(4.0 * (sharers * blocks * block_size).sum() * num_heads * head_size)


def chunk_first_rows(plan: TppPlan, num_heads: int, num_kv_heads: int) -> int:
    """GEMM rows per kv head of the widest shared node (0 when nothing is shared)."""
    sharers = np.diff(plan.node_seq_indptr.cpu().numpy())
    return int(sharers.max()) * (num_heads // num_kv_heads) if sharers.size else 0


def copy_bytes(device: torch.device) -> int:
    """2 GiB on a GPU, far past its L2, so a copy streams from and to HBM (256 MiB on a CPU)."""
    return (2 << 30) if device.type == "cuda" else (256 << 20)


def gemm_size(device: torch.device) -> int:
    return 8192 if device.type == "cuda" else 256     # CPU fp16 GEMM can be ~1 GFLOP/s


def measure_hbm_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 10) -> float:
    """GB/s of a device-to-device copy of copy_bytes (read + write bytes / time; kernel.Timer's
    median after a warm-up)."""
    nbytes = nbytes or copy_bytes(device)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = Timer(device)(lambda: dst.copy_(src), reps) / 1e3
    del src, dst
    return 2 * nbytes / seconds / 1e9


def measure_gemm_tflops(device: torch.device, dtype: torch.dtype, n: int | None = None,
                        reps: int = 10) -> float:
    """Dense n^3 torch.matmul TFLOP/s (median): the tensor-core peak this device reaches."""
    n = n or gemm_size(device)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = Timer(device)(lambda: a @ b, reps) / 1e3
    return 2.0 * n ** 3 / seconds / 1e12
