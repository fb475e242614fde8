"""Benchmark models at the shapes of real public architectures: config.json + the tiny model's
word-level tokenizer, no weights (serve with `--load-format dummy`; bench ab/offline add it).

    python -m vllm_chunkattn.bench.model_shapes --out models                  # all shapes
    python -m vllm_chunkattn.bench.model_shapes --out models llama-3.2-1b     # models/llama-3.2-1b

The configs are the public ones (meta-llama/Meta-Llama-3-8B, meta-llama/Llama-3.2-1B,
Qwen/Qwen2.5-32B, Qwen/Qwen2.5-1.5B, Qwen/Qwen2.5-0.5B, openai/gpt-oss-20b, google/gemma-3-1b-pt)
except the special token ids, which are the local tokenizer's. Its 2048 ids are fewer than the
config's vocab_size: the embedding keeps the real size (its cost is real), prompts use ids < 2048.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..tiny_model import save_tokenizer

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
          "pretraining_tp": 1, "torch_dtype": "bfloat16", "use_cache": True}
_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
          "attention_dropout": 0.0, "initializer_range": 0.02, "rope_theta": 1000000.0,
          "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "vocab_size": 151936,
          "use_sliding_window": False, "use_mrope": False, "torch_dtype": "bfloat16",
          "use_cache": True}

SHAPES: dict[str, dict] = {
    # The GPU A/B shape (benchmarks/gpu/README.md): 16 GB of bf16 weights, 128 KiB of KV a token.
    "llama-3-8b": {
        **_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False},
    "llama-3.2-1b": {
        **_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    # A small GQA 4:1 model (head 128), fp32: where per-step host work weighs most.
    "llama-3l-gqa4": {
        **_LLAMA, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128,
        "vocab_size": 2048, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32"},
    # Qwen2 configs carry sliding_window but use_sliding_window is false: full attention.
    # The second GPU prediction shape (bench tpot): 65 GB of bf16 weights, 256 KiB of KV a token.
    "qwen2.5-32b": {
        **_QWEN2, "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
        "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "sliding_window": 131072, "max_window_layers": 64},
    "qwen2.5-1.5b": {
        **_QWEN2, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 131072,
        "sliding_window": 131072, "max_window_layers": 28},
    "qwen2.5-0.5b": {
        **_QWEN2, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "sliding_window": 32768, "max_window_layers": 24},
}
# Sliding-window families: their attention shapes for `bench kernel` (with --sliding-window and
# --sinks for the windowed layers).
SHAPES["gpt-oss-20b"] = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "num_local_experts": 32,
    "num_experts_per_tok": 4, "vocab_size": 201088, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "attention_bias": True, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "truncate": False, "original_max_position_embeddings": 4096,
                        "rope_theta": 150000.0},
    "torch_dtype": "bfloat16"}
SHAPES["gemma-3-1b"] = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
    "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
    "sliding_window": 512, "vocab_size": 262144, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "bfloat16"}
WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


def attention_shape(name: str) -> tuple[int, int, int]:
    """(num_heads, num_kv_heads, head_size) of a shape in SHAPES."""
    c = SHAPES[name]
    head_size = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_attention_heads"], c["num_key_value_heads"], head_size


def describe(model_dir: str | Path) -> dict:
    """Name, layers, heads and head_size of any local model directory (for reports)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    return {"name": Path(model_dir).name, "architecture": (c.get("architectures") or ["?"])[0],
            "num_layers": c["num_hidden_layers"], "num_heads": c["num_attention_heads"],
            "num_kv_heads": c.get("num_key_value_heads", c["num_attention_heads"]),
            "head_size": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]}


def has_weights(model_dir: str | Path) -> bool:
    return any(any(Path(model_dir).glob(g)) for g in WEIGHT_GLOBS)


def make_shape_model(name: str, out: str | Path) -> Path:
    """Writes `out`/config.json (SHAPES[name]) and the tokenizer files; no weights."""
    out = save_tokenizer(out)
    config = {**SHAPES[name], "bos_token_id": 1, "eos_token_id": 2}   # the local tokenizer's
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench.model_shapes",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", default="models", help="parent folder: writes OUT/<name>")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"shapes to write (default all): {', '.join(SHAPES)}")
    args = p.parse_args(argv)
    bad = [n for n in args.names if n not in SHAPES]
    if bad:
        p.error(f"unknown shape(s) {bad}; choose from {list(SHAPES)}")
    for name in args.names or SHAPES:
        print(make_shape_model(name, Path(args.out) / name))


if __name__ == "__main__":
    main()
