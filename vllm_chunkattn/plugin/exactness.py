"""What TPP decode cannot compute exactly, and the one message that refuses it.

Two places ask. The worker's attention layers know their own arguments (backend.ChunkAttnImpl);
but by then an engine core and its workers have started, and `vllm serve` prints the reason
inside a worker's traceback, under the engine's "initialization failed". The process that builds
the config (the API server, or the user's `LLM(...)`) asks first, from what the config already
shows, so a refused start stops there, in seconds, with the reason in its one error (vLLM's
pydantic config wraps it: "Value error, <the reason>"). ALiBi and attention sinks are model code,
not config: the layers still refuse those.
"""
from __future__ import annotations

from vllm.v1.attention.backend import AttentionType

KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")     # a quantized cache is not read exactly


def refusal(reasons: list[str]) -> ValueError:
    return ValueError("--attention-backend CUSTOM (ChunkAttention) cannot serve this model "
                      f"exactly: {', '.join(reasons)}. Run without the flag to use vLLM's own "
                      "attention.")


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
