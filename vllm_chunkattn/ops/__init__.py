"""TPP decode over vLLM's paged KV cache: one entry point, dispatched to the native kernel of the
device (csrc/cpu, csrc/cuda) or to the PyTorch reference. Imports no vLLM.
"""
from __future__ import annotations

import torch

from ..plan import TppPlan
from .native import check_plan, kernel_name, native_ops
from .reference import dense_decode_oracle, tpp_decode_reference

__all__ = ["tpp_decode", "TppLaunch", "tpp_decode_reference", "dense_decode_oracle",
           "kernel_name", "TppWorkspace", "check_plan", "CUDA_BLOCK_SIZES"]

# Block sizes the CUDA kernel takes: powers of two (it finds a token's block by shift and mask,
# csrc/cuda/tpp_kernels.cuh), from 16 up, which FLASH_ATTN (it writes the KV cache and runs
# prefill under CUSTOM) also takes.
CUDA_BLOCK_SIZES = (16, 32, 64, 128, 256)


class TppWorkspace:
    """fp32 partial states of the chunk-first phase, grown on demand and reused across layers and
    steps (no per-call allocation once warm; fixed addresses for CUDA graphs once large enough).

    On CUDA, rows beyond num_partials are the split-KV scratch: the kernel splits long nodes and
    private tails only as far as these spare rows allow (csrc/cuda/tpp_decode.cu).
    spare_rows_per_partial: 0 for CUDA graphs, whose plans are padded to a capacity of partials
    (plan_capacity.py) that already leaves the kernel spare rows in most steps."""

    CUDA_SPARE_ROWS_PER_PARTIAL = 4
    CUDA_SPARE_ROWS_PER_SEQ = 8

    def __init__(self, spare_rows_per_partial: int = CUDA_SPARE_ROWS_PER_PARTIAL):
        self.spare_rows_per_partial = spare_rows_per_partial
        self.o = self.m = self.l = None

    def rows(self, num_partials: int, num_seqs: int, device) -> int:
        need = max(num_partials, 1)
        if torch.device(device).type == "cuda":
            need += self.spare_rows_per_partial * num_partials + self.CUDA_SPARE_ROWS_PER_SEQ * num_seqs
        return need

    def holds(self, num_partials: int, num_seqs: int, num_heads: int, head_size: int,
              device) -> bool:
        """Whether get() would return the tensors it holds now (no reallocation)."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:     # tensors always name their index
            dev = torch.device("cuda", torch.cuda.current_device())
        return (self.o is not None and self.o.device == dev
                and self.o.shape[0] >= self.rows(num_partials, num_seqs, device)
                and self.o.shape[1:] == (num_heads, head_size))

    def get(self, num_partials: int, num_seqs: int, num_heads: int, head_size: int, device):
        if not self.holds(num_partials, num_seqs, num_heads, head_size, device):
            need = self.rows(num_partials, num_seqs, device)
            self.o = torch.empty(need, num_heads, head_size, dtype=torch.float32, device=device)
            self.m = torch.empty(need, num_heads, dtype=torch.float32, device=device)
            self.l = torch.empty(need, num_heads, dtype=torch.float32, device=device)
        return self.o, self.m, self.l


_default_workspace = TppWorkspace()


class TppLaunch:
    """What tpp_decode needs that is the same for every layer of a step, resolved once per step
    (FlashInfer's plan/run split): the kernel, the plan's argument list, the workspace. Each
    layer's `run` is then one op call (the per-call Python work this removes was ~11 us, more
    than the whole op on a small batch).

    plan, block_table, seq_lens: as tpp_decode; num_heads, head_size: of the query rows."""

    def __init__(self, plan: TppPlan, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 num_heads: int, head_size: int, device: torch.device | str,
                 workspace: TppWorkspace | None = None, kernel: str | None = None):
        device = torch.device(device)
        self.plan, self.block_table, self.seq_lens = plan, block_table, seq_lens
        self.ops = native_ops(device) if kernel != "reference" else None
        if kernel == "native" and self.ops is None:
            raise RuntimeError(f"no native TPP kernel built for {device.type}")
        if self.ops is not None:
            p_o, p_m, p_l = (workspace or _default_workspace).get(
                plan.num_partials, plan.num_seqs, num_heads, head_size, device)
            self.plan_args = (block_table, seq_lens, plan.node_block_indptr, plan.node_block_ids,
                              plan.node_seq_indptr, plan.node_seq_ids, plan.seq_partial_indptr,
                              plan.seq_partial_ids, plan.seq_num_shared_blocks, p_o, p_m, p_l)

    def run(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            scale: float, out: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
        if self.ops is None:
            _, l = tpp_decode_reference(query, key_cache, value_cache, self.block_table,
                                        self.seq_lens, self.plan, scale, out=out, return_lse=True)
            if lse is not None:
                lse.copy_(l)
            return out
        self.ops.tpp_decode(query, key_cache, value_cache, *self.plan_args, scale, out, lse)
        return out


def tpp_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, plan: TppPlan, scale: float,
               out: torch.Tensor, lse: torch.Tensor | None = None,
               workspace: TppWorkspace | None = None, kernel: str | None = None) -> torch.Tensor:
    """Exact decode attention, two-phase over the plan's shared nodes and private tails.
    (One call, which checks the plan; for many layers of one step, check it once with check_plan
    on the host, build a TppLaunch once and call its run per layer.)

    query:       [num_seqs, num_heads, head_size], one new token per row (fp32/fp16/bf16)
    key_cache:   [num_blocks, block_size, num_kv_heads, head_size], any strides, last dim dense
    value_cache: same shape as key_cache
    block_table: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (new token included)
    plan:        TppPlan of this batch (plan tensors on query's device)
    out:         [num_seqs, num_heads, head_size], written in place and returned
    lse:         optional [num_seqs, num_heads] fp32, written with the natural-log LSE
    kernel:      "native" | "reference" | None (native when built for the device)
    """
    if query.device.type != "cpu":        # the CPU op checks the plan itself, on every call
        check_plan(plan.to("cpu"), block_table.cpu(), seq_lens.cpu(), key_cache.shape[1],
                   key_cache.shape[0])        # host copies: a sync, but this is the one-shot path
    launch = TppLaunch(plan, block_table, seq_lens, query.shape[1], query.shape[2], query.device,
                       workspace, kernel)
    return launch.run(query, key_cache, value_cache, scale, out, lse)
