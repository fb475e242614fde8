"""config.json of the Hugging Face models vLLM's tests name (public configs, no weights), so the
tests run offline: `write_redirects` makes one folder per model with its config and the tiny
model's tokenizer, and a VLLM_MODEL_REDIRECT_PATH file mapping the hub names to them. A
multimodal model also gets its image processor's config, and its image and vision tokens in the
tokenizer at the ids the model's config names (vLLM runs a dummy image through the processor to
size the encoder budget, and finds the image's place in the prompt by those ids)."""
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
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653,
        "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 11008, "max_position_embeddings": 128000, "max_window_layers": 70,
        "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                          "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                          "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
                          "spatial_patch_size": 14, "window_size": 112,
                          "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                          "temporal_patch_size": 2}},
    # vLLM 0.33's tests: speculative decoding (MTP) on a hybrid model.
    "Qwen/Qwen3-Next-80B-A3B-Instruct": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
        "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4,
        "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
        "max_position_embeddings": 262144, "mlp_only_layers": [], "moe_intermediate_size": 512,
        "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512,
        "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
        "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936},
}

_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
# Multimodal models: their image processor's config and their special tokens' ids.
IMAGE_PROCESSORS: dict[str, tuple[dict, dict[str, int]]] = {
    "llava-hf/llava-1.5-7b-hf": ({
        "crop_size": {"height": 336, "width": 336}, "do_center_crop": True,
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": _CLIP_MEAN, "image_processor_type": "CLIPImageProcessor",
        "image_std": _CLIP_STD, "processor_class": "LlavaProcessor", "resample": 3,
        "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 336}},
        {"<image>": 32000}),
    "Qwen/Qwen2.5-VL-3B-Instruct": ({
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD,
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"},
        {"<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
         "<|image_pad|>": 151655, "<|video_pad|>": 151656}),
}


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def write_redirects(out: Path) -> Path:
    """Writes the model folders under `out`; returns the redirect file."""
    from vllm_chunkattn.tiny_model import save_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    redirects = {}
    for name, config in HUB_CONFIGS.items():
        folder = out / name.replace("/", "--")
        if not (folder / "tokenizer.json").exists():
            save_tokenizer(folder)
        _write_if_changed(folder / "config.json", json.dumps({"_name_or_path": name, **config}))
        if name in IMAGE_PROCESSORS:
            processor, special_tokens = IMAGE_PROCESSORS[name]
            _write_if_changed(folder / "preprocessor_config.json", json.dumps(processor))
            tokenizer = json.loads((folder / "tokenizer.json").read_text())
            tokenizer["model"]["vocab"].update(special_tokens)
            _write_if_changed(folder / "tokenizer.json", json.dumps(tokenizer))
        redirects[name] = str(folder)
    path = out / "redirects.json"
    path.write_text(json.dumps(redirects, indent=1))
    return path
