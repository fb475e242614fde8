"""Everything of a decoder layer but its attention, as torch ops at decode batch B (one new token
a sequence), for `bench tpot`: the projections' GEMM shapes and weight counts from a model_shapes
config, and timed callables of one layer's non-attention work and of the model's head.
Weights are random: only their shapes and dtype matter to the time."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def head_size(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def has_qkv_bias(config: dict) -> bool:
    """Qwen2 always has q/k/v biases (its configs do not say so); Llama has attention_bias."""
    return config["model_type"] == "qwen2" or bool(config.get("attention_bias", False))


def gemm_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of one decoder layer, fused as vLLM fuses
    them (q/k/v into one qkv_proj, gate/up into one gate_up_proj)."""
    hidden, inter, d = config["hidden_size"], config["intermediate_size"], head_size(config)
    q_size = config["num_attention_heads"] * d
    kv_size = config["num_key_value_heads"] * d
    return {"qkv_proj": (hidden, q_size + 2 * kv_size), "o_proj": (q_size, hidden),
            "gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden)}


def layer_weight_count(config: dict) -> int:
    """Weights of one decoder layer's projections (biases and norms left out)."""
    return sum(i * o for i, o in gemm_shapes(config).values())


def layer_flops(config: dict, batch: int) -> float:
    """Multiply-adds x 2 of one layer's projections for `batch` new tokens."""
    return 2.0 * batch * layer_weight_count(config)


@dataclass
class LayerWeights:
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor

    @classmethod
    def random(cls, config: dict, dtype: torch.dtype, device) -> "LayerWeights":
        shapes = gemm_shapes(config)

        def weight(name):      # [out, in], as nn.Linear holds it
            i, o = shapes[name]
            return torch.empty(o, i, dtype=dtype, device=device).normal_(std=0.02)
        qkv_out = shapes["qkv_proj"][1]
        bias = (torch.zeros(qkv_out, dtype=dtype, device=device) if has_qkv_bias(config)
                else None)
        ones = torch.ones(config["hidden_size"], dtype=dtype, device=device)
        return cls(weight("qkv_proj"), bias, weight("o_proj"), weight("gate_up_proj"),
                   weight("down_proj"), ones, ones.clone())


def linear_op(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x -> x @ weight.T + bias as vLLM runs an unquantized linear layer on the weight's device:
    on CPU vLLM's own dispatch (oneDNN on prepacked weights, or its small-GEMM kernel), which is
    1.2-1.3x faster than F.linear at decode batch here; on CUDA F.linear (cuBLAS), as vLLM does.
    Only the CPU path imports vLLM (the GPU image has none)."""
    if weight.device.type != "cpu":
        return lambda x: F.linear(x, weight, bias)
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return lambda x: layer.cpu_linear(x, layer.weight, layer.bias)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def decoder_layer_without_attention(config: dict, weights: LayerWeights, batch: int):
    """A zero-argument callable: one decoder layer at `batch` new tokens, attention left out
    (timed apart): RMSNorm, qkv_proj (+ bias), rotary on q and k, o_proj, residual add, RMSNorm,
    gate_up_proj, SiLU * up, down_proj, residual add. The KV-cache write is left out too (the
    attention backend's, a B-token copy)."""
    hidden, eps = config["hidden_size"], config["rms_norm_eps"]
    d = head_size(config)
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    w = weights
    dtype, device = w.qkv.dtype, w.qkv.device
    x = torch.randn(batch, hidden, dtype=dtype, device=device)
    angles = torch.rand(batch, 1, d, device=device)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_size, kv_size = num_heads * d, num_kv_heads * d
    qkv_proj, o_proj = linear_op(w.qkv, w.qkv_bias), linear_op(w.o)
    gate_up_proj, down_proj = linear_op(w.gate_up), linear_op(w.down)

    def run():
        h = F.rms_norm(x, (hidden,), w.input_norm, eps)
        q, k, _v = qkv_proj(h).split([q_size, kv_size, kv_size], dim=-1)
        q = _rope(q.view(batch, num_heads, d), cos, sin)
        _rope(k.view(batch, num_kv_heads, d), cos, sin)
        # attention would read q and the cache here; its output has q's shape
        residual = x + o_proj(q.reshape(batch, q_size))
        gate, up = gate_up_proj(F.rms_norm(residual, (hidden,), w.post_attention_norm,
                                           eps)).chunk(2, dim=-1)
        return residual + down_proj(F.silu(gate) * up)
    return run


def lm_head_weight(config: dict, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(config["vocab_size"], config["hidden_size"], dtype=dtype,
                       device=device).normal_(std=0.02)


def lm_head(config: dict, weight: torch.Tensor, batch: int):
    """A zero-argument callable: the final RMSNorm, the [B, hidden] x [hidden, vocab] lm_head
    GEMM and greedy sampling's argmax over fp32 logits (the embedding lookup is left out: B rows
    gathered, negligible)."""
    hidden = config["hidden_size"]
    norm = torch.ones(hidden, dtype=weight.dtype, device=weight.device)
    x = torch.randn(batch, hidden, dtype=weight.dtype, device=weight.device)
    head_proj = linear_op(weight)

    def run():
        h = F.rms_norm(x, (hidden,), norm, config["rms_norm_eps"])
        return head_proj(h).float().argmax(dim=-1)
    return run
