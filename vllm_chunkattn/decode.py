"""Exact TPP decode as a library: plan once per step, run once per layer.

    import torch
    from vllm_chunkattn import TppDecodeWrapper

    # 3 sequences of 40 tokens sharing their first two blocks (16 tokens each) of KV.
    num_blocks, block_size, num_kv_heads, num_heads, head_size = 8, 16, 2, 8, 64
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size)
    value_cache = torch.randn_like(key_cache)
    block_table = torch.tensor([[1, 2, 3], [1, 2, 4], [1, 2, 5]], dtype=torch.int32)
    seq_lens = torch.tensor([40, 40, 40], dtype=torch.int32)
    wrapper = TppDecodeWrapper(block_size)
    plan = wrapper.plan(block_table, seq_lens, num_heads, head_size)
    assert plan.num_nodes == 1 and plan.num_partials == 3      # one shared node, three sharers
    for layer in range(2):                                    # ... every layer of the step
        query = torch.randn(3, num_heads, head_size)
        out = wrapper.run(query, key_cache, value_cache, scale=head_size ** -0.5)

Caches use vLLM's paged layout ([num_blocks, block_size, num_kv_heads, head_size], any strides,
last dim dense); block ids and seq_lens are vLLM's. The plan is rebuilt only when the sharing can
have changed (plan/cache.py). With use_cuda_graph, plans are padded to fixed capacities in one
device buffer and the partial states never move, so a captured `run` replays any later step's
tree (the caller keeps block_table / seq_lens in fixed device tensors, as vLLM does).
"""
from __future__ import annotations

import torch

from .ops.native import check_plan, native_ops
from .ops.reference import tpp_decode_reference
from .plan import PlanCache, PlanCapacity, TppPlan, TppWorkspace

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
            self.plan_args = (block_table, seq_lens, *plan.tensors(), p_o, p_m, p_l)

    def run(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            scale: float, out: torch.Tensor, lse: torch.Tensor | None = None,
            sliding_window: int = 0, soft_cap: float = 0.0,
            sinks: torch.Tensor | None = None, k_scale: float = 1.0,
            v_scale: float = 1.0) -> torch.Tensor:
        if self.ops is None:
            _, l = tpp_decode_reference(query, key_cache, value_cache, self.block_table,
                                        self.seq_lens, self.plan, scale, out=out, return_lse=True,
                                        sliding_window=sliding_window, soft_cap=soft_cap,
                                        sinks=sinks, k_scale=k_scale, v_scale=v_scale)
            if lse is not None:
                lse.copy_(l)
            return out
        self.ops.tpp_decode(query, key_cache, value_cache, *self.plan_args, scale, out, lse,
                            sliding_window, soft_cap, sinks, k_scale, v_scale)
        return out


def tpp_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, plan: TppPlan, scale: float,
               out: torch.Tensor, lse: torch.Tensor | None = None,
               workspace: TppWorkspace | None = None, kernel: str | None = None,
               sliding_window: int = 0, soft_cap: float = 0.0,
               sinks: torch.Tensor | None = None, k_scale: float = 1.0,
               v_scale: float = 1.0) -> torch.Tensor:
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
    sliding_window, soft_cap, sinks: the layer's attention variant: a row of seq_len L sees keys
                 [L - sliding_window, L) when sliding_window > 0; scores soft-capped to
                 soft_cap * tanh(s / soft_cap) when soft_cap > 0; sinks: fp32 [num_heads], one
                 logit per head added to each row's softmax denominator
    k_scale, v_scale: an fp8 cache's (float8_e4m3fn / float8_e5m2) per-tensor scales: it holds
                 K / k_scale and V / v_scale
    """
    if query.device.type != "cpu":        # the CPU op checks the plan itself, on every call
        check_plan(plan.to("cpu"), block_table.cpu(), seq_lens.cpu(), key_cache.shape[1],
                   key_cache.shape[0])        # host copies: a sync, but this is the one-shot path
    launch = TppLaunch(plan, block_table, seq_lens, query.shape[1], query.shape[2], query.device,
                       workspace, kernel)
    return launch.run(query, key_cache, value_cache, scale, out, lse, sliding_window, soft_cap,
                      sinks, k_scale, v_scale)


class TppDecodeWrapper:
    """One decode batch's attention over a paged KV cache, planned once per step (`plan`) and run
    once per layer (`run`), exactly (fp32 partial states, natural-log LSE merge).

    block_size:     tokens per KV block (vLLM's --block-size; the tree's chunk size)
    device:         where the kernel runs ("cpu" or a CUDA device)
    use_cuda_graph: pad plans to the capacity of max_num_seqs rows x table_width blocks, in
                    buffers that never move, so `run` can be captured once and replayed
    kernel:         "native" | "reference" | None (native when built for the device)
    """

    def __init__(self, block_size: int, device: torch.device | str = "cpu",
                 use_cuda_graph: bool = False, max_num_seqs: int | None = None,
                 table_width: int | None = None, kernel: str | None = None):
        self.block_size, self.device, self.kernel = block_size, torch.device(device), kernel
        capacity = None
        if use_cuda_graph:
            if max_num_seqs is None or table_width is None:
                raise ValueError("use_cuda_graph needs max_num_seqs and table_width")
            if self.device.type != "cuda" and kernel != "reference":
                raise ValueError("use_cuda_graph needs a CUDA device (the CPU kernel takes exact "
                                 "plans only)")
            capacity = PlanCapacity.for_batch(max_num_seqs, table_width)
        self.capacity = capacity
        self.plans = PlanCache(block_size, self.device, capacity=capacity)
        # Graph plans are padded to capacities that already leave the kernel spare rows.
        self.workspace = (TppWorkspace(spare_rows_per_partial=0) if use_cuda_graph
                          else TppWorkspace())
        self.launch: TppLaunch | None = None

    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, num_heads: int,
             head_size: int, num_blocks: int | None = None,
             device_block_table: torch.Tensor | None = None,
             device_seq_lens: torch.Tensor | None = None) -> TppPlan:
        """block_table: [num_seqs, max_blocks] int32 and seq_lens: [num_seqs] int32 (new token
        included), on the host; device_*: the same on the wrapper's device (copied from the host
        ones when not given); num_heads, head_size: of the query; num_blocks: of the KV cache,
        for the plan's bounds check. Returns the step's plan (on the device)."""
        if self.capacity is not None and block_table.shape[0] != self.capacity.num_seqs:
            raise ValueError(f"a graph-mode plan takes exactly {self.capacity.num_seqs} rows "
                             f"(pad the batch with seq_len 0 rows), got {block_table.shape[0]}")
        plan = self.plans.get(block_table, seq_lens, num_blocks)
        bt = block_table.to(self.device) if device_block_table is None else device_block_table
        sl = seq_lens.to(self.device) if device_seq_lens is None else device_seq_lens
        self.launch = TppLaunch(plan, bt, sl, num_heads, head_size, self.device, self.workspace,
                                self.kernel)
        return plan

    def run(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            scale: float, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, sliding_window: int = 0, soft_cap: float = 0.0,
            sinks: torch.Tensor | None = None, k_scale: float = 1.0,
            v_scale: float = 1.0) -> torch.Tensor:
        """query: [num_seqs, num_heads, head_size]; key_cache, value_cache: [num_blocks,
        block_size, num_kv_heads, head_size]; out (written in place, allocated when None) as
        query; lse: optional [num_seqs, num_heads] fp32, natural log; sliding_window,
        soft_cap, sinks, k_scale, v_scale: as tpp_decode. Returns out."""
        if self.launch is None:
            raise RuntimeError("TppDecodeWrapper.run before plan")
        if out is None:
            out = torch.empty_like(query)
        return self.launch.run(query, key_cache, value_cache, scale, out, lse, sliding_window,
                               soft_cap, sinks, k_scale, v_scale)
