"""The contenders a kernel bench times on one decode batch: our op as a layer calls it (the step's
plan and launch built beforehand), per-sequence SDPA, vLLM's CPU_ATTN, FlashInfer's batch decode;
and what every bench reports beside them (the machine, an error's reason, attention FLOPs)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..decode import TppLaunch
from ..kv_layout import FP8_KV_CACHE_DTYPES, block_size_of, logical_cache
from ..plan import TppWorkspace
from ..plan.cache import PlanCache
from . import provenance
from .kv_pool import Batch
from .timing import Timer


@dataclass(frozen=True)
class Variant:
    """The attention variant of the timed layer: a sliding window (0: none), a logit soft-cap
    (0: none), attention sinks (one fixed random logit per head), and the KV cache's dtype as
    vLLM names it ("auto": the model's; "fp8" / "fp8_e5m2": fp8 at k/v scales of 1)."""
    sliding_window: int = 0
    soft_cap: float = 0.0
    sinks: bool = False
    kv_cache_dtype: str = "auto"

    @property
    def fp8_dtype(self) -> torch.dtype | None:
        return FP8_KV_CACHE_DTYPES.get(self.kv_cache_dtype)

    def sink_logits(self, num_heads: int, device) -> torch.Tensor | None:
        if not self.sinks:
            return None
        return torch.randn(num_heads, generator=torch.Generator().manual_seed(0)).to(device)

    def label(self) -> str:
        parts = ([f"window {self.sliding_window}"] if self.sliding_window else []) + (
            [f"soft-cap {self.soft_cap:g}"] if self.soft_cap else []) + (
            ["sinks"] if self.sinks else [])
        cache = f", {self.kv_cache_dtype} KV cache" if self.kv_cache_dtype != "auto" else ""
        return (", ".join(parts) or "full causal attention") + cache


FULL_ATTENTION = Variant()


def ours(bt: Batch, plan, workspace: TppWorkspace | None = None,
         variant: Variant = FULL_ATTENTION):
    """One layer's call, as the backend makes it: the step's TppLaunch is built beforehand.
    workspace: its own TppWorkspace() unless given (graph mode: no split spares)."""
    out = torch.empty_like(bt.query)
    launch = TppLaunch(plan.to(bt.query.device), bt.block_table, bt.seq_lens, bt.query.shape[1],
                       bt.query.shape[2], bt.query.device, workspace or TppWorkspace(),
                       kernel="native")
    sinks = variant.sink_logits(bt.query.shape[1], bt.query.device)
    return lambda: launch.run(bt.query, bt.key_cache, bt.value_cache, bt.scale, out, None,
                              variant.sliding_window, variant.soft_cap, sinks)


def plan_step(bt: Batch, block_size: int):
    """The host work of one step, shared by every layer, as ChunkAttnMetadataBuilder.build does
    it on a rebuild: a PlanCache that never reuses (key, plan, shared-token count, the host plan
    check on a GPU, the upload: pinned staging and an async copy there), then TppLaunch. Time it
    with the host clock (Timer(cpu)): it is host work, and the copy overlaps the GPU."""
    host_table, host_lens = bt.block_table.cpu().numpy(), bt.seq_lens.cpu().numpy()
    plans = PlanCache(block_size, bt.query.device)
    plans.enabled = False
    workspace = TppWorkspace()

    def run():
        plan = plans.get(host_table, host_lens)
        return TppLaunch(plan, bt.block_table, bt.seq_lens, bt.query.shape[1], bt.query.shape[2],
                         bt.query.device, workspace, kernel="native")
    return run


def host_ms(fn, reps: int) -> float:
    """Median host milliseconds of fn (wall clock, no device events)."""
    return Timer(torch.device("cpu"))(fn, reps)


def vllm_cpu_isa(dtype: torch.dtype, block_size: int, head_size: int,
                 kv_cache_dtype: str = "auto") -> str:
    """The CPU_ATTN ISA vLLM itself picks on this machine (amx where the CPU has AMX)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    return _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)


def sdpa_per_sequence(bt: Batch):
    """Naive: gather each sequence's KV, one SDPA call per sequence (GQA by the op)."""
    bs = block_size_of(bt.key_cache)
    out = torch.empty_like(bt.query)
    lens = bt.seq_lens.tolist()

    def run():
        for i, n in enumerate(lens):
            ids = bt.block_table[i, :-(-n // bs)].long()
            k = logical_cache(bt.key_cache[ids]).flatten(0, 1)[:n].transpose(0, 1)
            v = logical_cache(bt.value_cache[ids]).flatten(0, 1)[:n].transpose(0, 1)
            out[i] = F.scaled_dot_product_attention(bt.query[i][:, None], k, v, scale=bt.scale,
                                                    enable_gqa=True)[:, 0]
        return out
    return run


def cpu_attn(bt: Batch, isa: str, variant: Variant = FULL_ATTENTION,
             query_start_loc: torch.Tensor | None = None):
    """vLLM's CPU_ATTN decode, called as vllm/v1/attention/backends/cpu_attn.py calls it.
    query_start_loc: [num_seqs + 1] int32 where rows have several query tokens (bt.query holds
    them all, causal within each row); None: one query token a row."""
    from vllm import _custom_ops as ops
    num_heads, head_size = bt.query.shape[1:]
    num_seqs = bt.seq_lens.shape[0]
    num_blocks, num_kv_heads, block_size, _ = bt.kv_cache.shape
    key_cache, value_cache = bt.kv_cache.view(num_blocks, num_kv_heads, block_size * 2,
                                              head_size).chunk(2, dim=2)
    if query_start_loc is None:
        query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size,
        seq_lens=bt.seq_lens, dtype=bt.query.dtype, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=variant.sliding_window or -1, isa=isa,
        enable_kv_split=_vllm_split_kv())
    out = torch.empty_like(bt.query)
    sinks = variant.sink_logits(num_heads, bt.query.device)

    def run():
        ops.cpu_attention_with_kv_cache(
            query=bt.query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=query_start_loc, seq_lens=bt.seq_lens, scale=bt.scale, causal=True,
            alibi_slopes=None, sliding_window=variant.sliding_window or -1,
            block_table=bt.block_table, softcap=variant.soft_cap, scheduler_metadata=sched,
            s_aux=sinks, k_scale=1.0, v_scale=1.0, kv_cache_dtype=variant.kv_cache_dtype)
        return out
    return run


def _vllm_split_kv() -> bool:
    from vllm import envs
    return envs.VLLM_CPU_ATTN_SPLIT_KV


def flashinfer_decode(bt: Batch):
    """FlashInfer's paged batch decode (no prefix awareness: flashinfer_baselines.batch_decode),
    planned and run once, as (callable, "") or (None, why not). Any failure is a reason, not a
    crash: a JIT build that fails inside plan() raises RuntimeError, not ImportError, and the
    bench that asked for the baseline carries on without it."""
    if bt.query.dtype not in (torch.float16, torch.bfloat16):
        return None, f"FlashInfer decode has no {bt.query.dtype} kernels"
    try:
        from .flashinfer_baselines import batch_decode
        fn = batch_decode(bt, bt.key_cache.shape[1])
        fn()
    except Exception as e:
        return None, error_reason(e, 160)
    return fn, ""


def error_reason(e: Exception, limit: int) -> str:
    """A baseline left out, in one line: the exception's type and its message's first line."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:limit]}"


# ---- timing

def attention_flops(bt: Batch) -> float:
    num_heads, head_size = bt.query.shape[1:]
    return 4.0 * num_heads * head_size * float(bt.seq_lens.sum())


def machine() -> str:
    return (f"{provenance.machine()}, torch {torch.__version__} ({torch.get_num_threads()} "
            f"threads, {torch.backends.cpu.get_cpu_capability()}), load average "
            f"{provenance.load_average()}, commit {provenance.git_commit()}")
