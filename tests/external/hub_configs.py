"""config.json of the Hugging Face models vLLM's tests name (public configs, no weights), so the
tests run offline: `write_redirects` makes one folder per model with its config and the tiny
model's tokenizer, and a VLLM_MODEL_REDIRECT_PATH file mapping the hub names to them."""
from __future__ import annotations

import json
from pathlib import Path

_OPT = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_dropout": 0.0,
        "activation_function": "relu", "attention_dropout": 0.0, "bos_token_id": 2,
        "dropout": 0.1, "eos_token_id": 2, "init_std": 0.02, "layerdrop": 0.0,
        "max_position_embeddings": 2048, "pad_token_id": 1, "prefix": "</s>",
        "torch_dtype": "float16", "use_cache": True, "vocab_size": 50272}
_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
          "attention_dropout": 0.0, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
          "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
          "vocab_size": 151936, "bos_token_id": 151643}

HUB_CONFIGS: dict[str, dict] = {
    "facebook/opt-125m": {**_OPT, "hidden_size": 768, "ffn_dim": 3072, "num_hidden_layers": 12,
                          "num_attention_heads": 12, "do_layer_norm_before": True,
                          "word_embed_proj_dim": 768},
    "facebook/opt-350m": {**_OPT, "hidden_size": 1024, "ffn_dim": 4096, "num_hidden_layers": 24,
                          "num_attention_heads": 16, "do_layer_norm_before": False,
                          "word_embed_proj_dim": 512},
    # ModelConfig()'s default model.
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "head_dim": 128, "hidden_size": 1024, "initializer_range": 0.02,
        "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
    "Qwen/Qwen1.5-7B": {
        **_QWEN2, "eos_token_id": 151643, "hidden_size": 4096, "intermediate_size": 11008,
        "max_position_embeddings": 32768, "max_window_layers": 28, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 32, "rope_theta": 1000000.0,
        "sliding_window": 32768, "tie_word_embeddings": False},
    "meta-llama/Meta-Llama-3-8B": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
        "eos_token_id": 128001, "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 8192, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
        "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 128256},
    "llava-hf/llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "ignore_index": -100, "image_token_index": 32000, "pad_token_id": 32001,
        "projector_hidden_act": "gelu", "tie_word_embeddings": False, "torch_dtype": "float16",
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
        "vocab_size": 32064,
        "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5",
                        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                        "torch_dtype": "float16", "vocab_size": 32064},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024,
                          "image_size": 336, "intermediate_size": 4096,
                          "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14,
                          "projection_dim": 768, "vocab_size": 32000}},
}


def write_redirects(out: Path) -> Path:
    """Writes the model folders under `out`; returns the redirect file."""
    from vllm_chunkattn.tiny_model import save_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    redirects = {}
    for name, config in HUB_CONFIGS.items():
        folder = out / name.replace("/", "--")
        if not (folder / "config.json").exists():
            save_tokenizer(folder)
            (folder / "config.json").write_text(json.dumps({"_name_or_path": name, **config}))
        redirects[name] = str(folder)
    path = out / "redirects.json"
    path.write_text(json.dumps(redirects, indent=1))
    return path
