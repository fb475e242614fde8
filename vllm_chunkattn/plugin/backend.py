"""ChunkAttention as a vLLM attention backend (name "CUSTOM").

Decode rows (one new token each, or speculative decoding's verify rows: the new token and its
draft tokens) go through TPP decode, driven by a TppPlan built once per step from the batch's
block table; a verify row enters the plan as one row per query token (plan/query_rows.py).
Prefill and chunked-prefill rows, and the KV cache writes, go through vLLM's own backend for
the platform (CPU_ATTN on CPU, FLASH_ATTN on GPU), so the KV cache keeps that backend's layout
and our kernels read it in place.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from vllm.platforms import current_platform
from vllm.utils.gpu_sync_debug import gpu_sync_allowed
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                       AttentionMetadataBuilder, AttentionType,
                                       CommonAttentionMetadata, MultipleOf)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import KVCacheLayout, SlidingWindowSpec
from vllm.v1.worker.ubatch_utils import UBatchSlice, split_attn_metadata

from .. import __version__, envs
from ..kv_layout import kv_cache_views
from ..decode import TppLaunch
from ..ops import kernel_name, reads_cpu_attn_amx_layout
from ..plan import PlanCache, PlanCapacity, TppPlan, TppWorkspace, query_rows
from . import batch_order, logger
from .support import (CUDA_BLOCK_SIZES, FP8_KV_CACHE_DTYPES, cuda_refusal, head_sizes,
                      kv_cache_dtypes, layer_refusals, refusal)
from .host_block_table import host_block_table, host_seq_lens
from .stats import SHARING_STATS

def _platform_base():
    """vLLM's own backend for this platform, and the KV layout it writes."""
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        return CPUAttentionBackend, "cpu_attn", (KVCacheLayout.LBHNC,)
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    return FlashAttentionBackend, "flash", (KVCacheLayout.LBNHC,)


class ChunkAttnBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = kv_cache_dtypes(current_platform.is_cpu())

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        # The CUDA kernel runs on tensor cores (fp16/bf16); fp32 is served on CPU only.
        return dtype in cls.supported_dtypes and (dtype != torch.float32
                                                  or current_platform.is_cpu())

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # Exact sizes on CUDA: for a larger vLLM block, vLLM then picks the largest of these that
        # divides it and splits each block into kernel blocks of that size.
        return [16, MultipleOf(32)] if current_platform.is_cpu() else list(CUDA_BLOCK_SIZES)

    @classmethod
    def supports_sink(cls) -> bool:
        # Decode rows take sinks in the kernel; prefill rows in the platform's backend, which
        # on CPU is CPU_ATTN (it runs sinks, and vLLM's CPU selection never asks it).
        return current_platform.is_cpu() or _platform_base()[0].supports_sink()

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return _platform_base()[0].supports_sliding_window()

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(head_sizes(current_platform.is_cpu()))

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink,
                             use_sparse, use_mm_prefix, device_capability, *args,
                             **kwargs) -> str | None:
        # vLLM's CUDA platform asks this at backend selection, in the worker, on its device:
        # a GPU the tensor-core kernel cannot serve is refused there, with the reason.
        if device_capability is None or current_platform.is_cpu():
            return None
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return cuda_refusal((device_capability.major, device_capability.minor), head_size,
                                getattr(props, "shared_memory_per_block_optin", 0))

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return _platform_base()[2]

    @staticmethod
    def get_impl_cls() -> type["ChunkAttnImpl"]:
        return ChunkAttnImpl

    @staticmethod
    def get_builder_cls() -> type["ChunkAttnMetadataBuilder"]:
        return ChunkAttnMetadataBuilder


@dataclass
class ChunkAttnMetadata:
    """Decode rows come first (reorder_batch_threshold): rows [0, num_decodes) are decodes,
    with 1 + num_speculative_tokens query tokens at most, their tokens [0, num_decode_tokens);
    the rest is vLLM's own metadata for the prefill rows. TPP's rows are the decode tokens
    (plan/query_rows.py): one per decode row without draft tokens."""
    num_actual_tokens: int
    num_decodes: int
    decode_block_table: torch.Tensor   # [num_decode_tokens, max_blocks] int32
    decode_seq_lens: torch.Tensor      # [num_decode_tokens] int32, each query token's own
    plan: TppPlan | None
    decode: TppLaunch | None           # the plan's op arguments, resolved once for all layers
    prefill: object | None             # the platform backend's metadata for prefill rows
    slot_mapping: torch.Tensor         # [num_actual_tokens] int64: KV cache slot of each token
    num_decode_tokens: int             # TPP's rows: num_decodes unless draft tokens are verified


_announced = False
# Every ChunkAttnImpl of the process: a new builder means a new KV cache is about to be bound
# (vLLM makes builders, then allocates the cache; the first time for a throwaway profiling cache
# whose graphs it captures), so the builder drops the impls' cached views of the old one, which
# would otherwise keep it alive (~1 GiB for Llama-3-8B at 512 blocks) through the allocation.
_IMPLS: weakref.WeakSet = weakref.WeakSet()


class ChunkAttnMetadataBuilder(AttentionMetadataBuilder[ChunkAttnMetadata]):
    # vLLM's FULL decode graphs include TPP: a uniform single-token decode batch of a captured
    # size runs on a plan padded to that size's capacities, in device buffers that never move
    # (plan/capacity.py), so the graph replays whatever tree the step holds. Batches with
    # prefill rows run outside graphs (PIECEWISE), on exact plans.
    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    reorder_batch_threshold: int = 1

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # The PyTorch reference (CHUNKATTN_ALLOW_REFERENCE=1, no native kernel) reads the plan
        # on the host (.tolist()): inside a graph capture that is an illegal sync.
        if kernel_name(current_platform.device_type) == "torch-reference":
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        for impl in list(_IMPLS):
            impl._views = None
        base_backend, self.kv_layout, _ = _platform_base()
        self.base = base_backend.get_builder_cls()(kv_cache_spec, layer_names, vllm_config,
                                                   device)
        if getattr(self.base, "isa", None) == "amx" and not reads_cpu_attn_amx_layout(
                kv_cache_spec.head_size, kv_cache_spec.dtype):
            # CPU_ATTN's AMX layout, which only our bf16 kernels read: vec is its portable one.
            self.base.isa = "vec"
            self.base._set_isa_to_layers(layer_names)
        self.block_size = kv_cache_spec.block_size
        self.num_heads = vllm_config.model_config.get_num_attention_heads(
            vllm_config.parallel_config)
        self.head_size = kv_cache_spec.head_size
        self.device = device
        self.plans = PlanCache(self.block_size, device)
        # Verify rows (1 + num_speculative_tokens query tokens) count as decodes, as in
        # vLLM's FlashInfer and FlashAttention builders: TPP serves them as query rows (and
        # prefill chunks as short: the same causal rows).
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        # Per captured batch size: its capacity-mode plans and the workspace its graph holds.
        self.graph_plans: dict[int, tuple[PlanCache, TppWorkspace]] = {}
        self._graph_workspace: TppWorkspace | None = None
        self._max_graph_batch = min(vllm_config.compilation_config.max_cudagraph_capture_size or 0,
                                    vllm_config.scheduler_config.max_num_seqs or 0)
        self._num_blocks: int | None = None
        self._warned_copy = False
        batch_order.install()     # reorder_batch_threshold's per-step cost, where nothing moves
        self._check_host_rows = envs.CHECK_HOST_ROWS         # knobs read once, not every step
        self._exact_seq_lens = vllm_config.speculative_config is None
        # A window group of a hybrid KV cache holds null blocks before each row's window: the
        # full group's builder counts the step's sharing, once.
        self._records_sharing = not (
            isinstance(kv_cache_spec, SlidingWindowSpec)
            and vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False)
        SHARING_STATS.publish_to_metrics(vllm_config)
        global _announced
        if not _announced:
            kernel = kernel_name(device)
            # The PyTorch reference decodes 10-100x slower: serve with it only when asked to.
            allow_reference = envs.ALLOW_REFERENCE
            if kernel == "torch-reference" and not allow_reference:
                raise RuntimeError(
                    f"vllm-chunkattn: no native TPP decode kernel for device {device} (the "
                    "extension was not built for it, or does not load). Rebuild it from the "
                    "source checkout with `pip install -e . --no-build-isolation`, or set "
                    "CHUNKATTN_ALLOW_REFERENCE=1 to serve with the PyTorch reference (slow).")
            _announced = True
            isa = getattr(self.base, "isa", None)       # CPU_ATTN's: what its kernels and cache use
            logger.info("vllm-chunkattn %s: ChunkAttention backend (CUSTOM) in use: TPP decode "
                        "kernel=%s, chunk size=%d tokens (= vLLM block size), prefill and KV "
                        "writes via %s%s", __version__, kernel, self.block_size,
                        base_backend.get_name(), f" (isa {isa})" if isa else "")
            if kernel == "torch-reference":
                logger.warning("CHUNKATTN_ALLOW_REFERENCE=1: TPP decode runs the PyTorch "
                               "reference, 10-100x slower than the native kernel")

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> ChunkAttnMetadata:
        cm = common_attn_metadata
        if cm.max_query_len == 1:     # uniform single-token decode: the graphs TPP is part of
            self._graph_plans_for(cm.num_reqs, cm.block_table_tensor.shape[1])
        return self._build(cm, record_stats=False)     # a dummy batch: not a served step

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> ChunkAttnMetadata:
        return self._build(common_attn_metadata, record_stats=True)

    def _build(self, cm: CommonAttentionMetadata, record_stats: bool) -> ChunkAttnMetadata:
        if cm.causal is not True:
            # vLLM's selector never picks CUSTOM for non-causal attention (supports_non_causal
            # is False); split_attn_metadata would drop the flag and make prefill rows causal.
            raise NotImplementedError("CUSTOM (ChunkAttention) serves causal attention only")
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cm, decode_threshold=self.reorder_batch_threshold)
        block_table = cm.block_table_tensor[:num_decodes]
        seq_lens = cm.seq_lens[:num_decodes]
        plan = decode = None
        if num_decodes:
            host_table, decode_seq_lens = self._host_rows(cm, num_decodes)
            plans, workspace, query_start_loc = self.plans, None, None
            if num_decode_tokens != num_decodes:
                query_start_loc = cm.query_start_loc_cpu[:num_decodes + 1].numpy()
            elif num_prefills == 0 and num_decodes in self.graph_plans:
                plans, workspace = self.graph_plans[num_decodes]   # a graph may replay this step
            plan = plans.get(host_table, decode_seq_lens,
                             self._num_kv_blocks() if plans.check_on_host else None,
                             query_start_loc)
            if query_start_loc is not None:
                block_table, seq_lens, host_table, decode_seq_lens = self._query_rows(
                    query_start_loc, block_table, host_table, decode_seq_lens)
            decode = TppLaunch(plan, block_table, seq_lens, self.num_heads, self.head_size,
                               self.device, workspace)
            if record_stats and self._records_sharing:
                self._record_sharing(host_table, decode_seq_lens, plans, num_prefills > 0)
        prefill = None
        if num_prefills:
            rows = slice(num_decodes, cm.num_reqs)
            tokens = slice(num_decode_tokens, cm.num_actual_tokens)
            prefill = self.base.build(0, split_attn_metadata([UBatchSlice(rows, tokens)], cm)[0])
        return ChunkAttnMetadata(cm.num_actual_tokens, num_decodes, block_table, seq_lens, plan,
                                 decode, prefill, slot_mapping=cm.slot_mapping,
                                 num_decode_tokens=num_decode_tokens)

    def _query_rows(self, query_start_loc: np.ndarray, block_table: torch.Tensor,
                    host_table: np.ndarray, host_seq_lens: np.ndarray
                    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
        """Decode rows with several query tokens (verify rows) as one TPP row per query token
        (plan/query_rows.py): the block tables and seq_lens of those rows, on the device and
        on the host. Padding rows past vLLM's requests have no query token, hence no TPP row."""
        row_of_token, token_seq_lens = query_rows(query_start_loc, host_seq_lens)
        token_seq_lens = token_seq_lens.astype(np.int32)
        rows = torch.from_numpy(row_of_token)
        device = block_table.device
        if device.type != "cpu":
            rows = rows.to(device, non_blocking=True)
        return (block_table.index_select(0, rows),
                torch.from_numpy(token_seq_lens).to(device, non_blocking=device.type != "cpu"),
                host_table[row_of_token], token_seq_lens)

    def _graph_plans_for(self, num_seqs: int, table_width: int) -> tuple[PlanCache, TppWorkspace]:
        """The capacity-mode plans of a captured batch size, and its graph's workspace. One
        workspace serves every size (graphs replay one at a time), sized at the first capture
        for the largest graph batch; a size it cannot hold gets its own, so the tensors a
        captured graph points at are never freed."""
        if num_seqs not in self.graph_plans:
            cap = PlanCapacity.for_batch(num_seqs, table_width)
            ws = self._graph_workspace
            if ws is None or not ws.holds(cap.num_partials, num_seqs, self.num_heads,
                                          self.head_size, self.device):
                largest = max(num_seqs, self._max_graph_batch)
                ws = self._graph_workspace = TppWorkspace(spare_rows_per_partial=0)
                ws.get(PlanCapacity.for_batch(largest, table_width).num_partials, largest,
                       self.num_heads, self.head_size, self.device)
            self.graph_plans[num_seqs] = (PlanCache(self.block_size, self.device,
                                                    capacity=cap), ws)
        return self.graph_plans[num_seqs]

    def _record_sharing(self, host_table: np.ndarray, seq_lens: np.ndarray, plans: PlanCache,
                        with_prefill: bool) -> None:
        """Counts a step's served decode rows. Not served: rows past vLLM's real ones (graph
        padding, seq_len 0), and the rows of vLLM's dummy batches (the warm-up runs before graph
        capture, an idle data-parallel rank's step), which point at the null block 0 that the KV
        manager never hands to a request."""
        served = seq_lens > 0
        if host_table.shape[1]:
            served &= host_table[:, 0] != 0
        num_rows = int(served.sum())
        if num_rows:
            kv_tokens = seq_lens.sum() if num_rows == len(seq_lens) else seq_lens[served].sum()
            SHARING_STATS.record(num_rows, int(kv_tokens), plans.shared_kv_tokens,
                                 self._num_plan_builds(), with_prefill)

    def _num_plan_builds(self) -> int:
        return self.plans.num_builds + sum(p.num_builds for p, _ in self.graph_plans.values())

    def _host_rows(self, cm: CommonAttentionMetadata, num_rows: int) -> tuple[np.ndarray,
                                                                              np.ndarray]:
        """The decode rows' block table and seq_lens from vLLM's host copies: reading the device
        tensors would make the host wait for the GPU every step (plugin/host_block_table.py).
        Where vLLM keeps no host copy the rows are copied, with a warning once."""
        table = host_block_table(cm, num_rows, self.block_size, self._check_host_rows)
        seq_lens = host_seq_lens(cm, num_rows, self._exact_seq_lens, self._check_host_rows)
        if table is None or seq_lens is None:
            if not self._warned_copy:
                self._warned_copy = True
                logger.warning("vllm-chunkattn: no host copy of the decode rows' %s in this "
                               "configuration: copying it from the device, a host sync every "
                               "step", "block table" if table is None else "seq_lens")
            with gpu_sync_allowed():
                if table is None:
                    table = cm.block_table_tensor[:num_rows].cpu().numpy()
                if seq_lens is None:
                    seq_lens = cm.seq_lens[:num_rows].cpu()
        return table, seq_lens[:num_rows].numpy()

    def _num_kv_blocks(self) -> int | None:
        """Blocks of this group's KV cache, bound to the layers after the builder was made (None
        until then): the host plan check's bound on block ids."""
        if self._num_blocks is None:
            layers = self.vllm_config.compilation_config.static_forward_context
            kv = getattr(layers.get(self.layer_names[0]), "kv_cache", None)
            if isinstance(kv, torch.Tensor) and kv.dim() == 4 and kv.shape[0] > 0:
                self._num_blocks = int(kv.shape[0])
        return self._num_blocks


class ChunkAttnImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window, kv_cache_dtype: str, logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 **extra_impl_args):
        reasons = layer_refusals(alibi_slopes, attn_type, kv_cache_dtype, head_size,
                                 current_platform.is_cpu())
        if reasons:
            raise refusal(reasons)
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        # The layer's attention variant, as the kernel takes it (0: none).
        self.sliding_window = int(sliding_window or 0)
        self.soft_cap = float(logits_soft_cap or 0.0)
        self.sinks = extra_impl_args.get("sinks")     # the model's parameter, loaded later
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        # An fp8 cache is allocated as uint8: the kernel reads it through an fp8 view.
        self.fp8_dtype = FP8_KV_CACHE_DTYPES.get(kv_cache_dtype)
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        base_backend, self.kv_layout, _ = _platform_base()
        self._views = None
        _IMPLS.add(self)
        self.base = base_backend.get_impl_cls()(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
            kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
            **extra_impl_args)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: ChunkAttnMetadata | None,
                output: torch.Tensor, output_scale=None, output_block_scale=None) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_size]; key/value: [num_tokens, num_kv_heads,
        head_size]; kv_cache: [num_blocks, num_kv_heads, block_size, 2 * head_size] (logical);
        output: [num_tokens, num_heads, head_size], written in place."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by CUSTOM")
        if attn_metadata is None:            # profiling / warm-up run
            return output
        md = attn_metadata
        nd = md.num_decode_tokens
        if nd:
            key_cache, value_cache = self._kv_views(kv_cache, getattr(layer, "isa", None))
            # An fp8 cache's per-tensor scales: the layer's, as vLLM's own backend reads them.
            scales = ((layer._k_scale_float, layer._v_scale_float) if self.fp8_dtype is not None
                      else (1.0, 1.0))
            md.decode.run(query[:nd], key_cache, value_cache, self.scale, output[:nd], None,
                          self.sliding_window, self.soft_cap, self._sinks_for_kernel(), *scales)
            # (layers run one after another, so all share the process's default workspace)
        if md.prefill is not None:
            end = md.num_actual_tokens
            self.base.forward(layer, query[nd:end], key[nd:end], value[nd:end], kv_cache,
                              md.prefill, output[nd:end])
        return output

    def _sinks_for_kernel(self) -> torch.Tensor | None:
        """The sinks as the kernel reads them (fp32, contiguous): the parameter itself when it
        is, else a fresh copy every call (a [num_heads] cast), so values loaded or updated in
        place after start-up are always the ones used."""
        s = self.sinks
        if s is None or (s.dtype == torch.float32 and s.is_contiguous()):
            return s
        return s.detach().float().contiguous()

    def _kv_views(self, kv_cache: torch.Tensor, isa: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        # A layer's cache tensor is allocated once: make its K/V views once, not every step.
        # CPU_ATTN's builder sets the layer's isa; "amx" caches hold its AMX layout.
        if self._views is None or self._views[0] is not kv_cache:
            layout = "cpu_attn_amx" if isa == "amx" else self.kv_layout
            views = kv_cache_views(kv_cache, layout)
            if self.fp8_dtype is not None:
                views = tuple(v.view(self.fp8_dtype) for v in views)
            self._views = (kv_cache, *views)
        return self._views[1], self._views[2]

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        self.base.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
