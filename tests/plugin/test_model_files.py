"""Local model directories: the Llama-3-8B shape (config + tokenizer, served with dummy weights)
and the tiny real-weight model in each dtype (the same seeded weights, rounded)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from vllm_chunkattn.bench.model_shapes import attention_shape, has_weights, make_shape_model  # noqa: E402
from vllm_chunkattn.tiny_model import make_tiny_model  # noqa: E402


def test_llama_3_8b_shape(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    d = make_shape_model("llama-3-8b", tmp_path / "llama-3-8b")
    assert not has_weights(d)
    c = AutoConfig.from_pretrained(d)
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (4096, 14336, 32)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 8, 128)
    assert (c.vocab_size, c.tie_word_embeddings, c.rms_norm_eps) == (128256, False, 1e-5)
    assert json.loads((d / "config.json").read_text())["rope_theta"] == 500000.0
    assert attention_shape("llama-3-8b") == (32, 8, 128)
    params = (2 * c.vocab_size * c.hidden_size + c.num_hidden_layers * (
        2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * c.num_key_value_heads * c.head_dim
        + 3 * c.hidden_size * c.intermediate_size))
    assert 8.0e9 < params < 8.1e9                 # Meta-Llama-3-8B: 8.03 B
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.bos_token_id == c.bos_token_id and tok.eos_token_id == c.eos_token_id


def test_tiny_model_dtypes_hold_the_same_weights(tmp_path):
    import torch
    from safetensors.torch import load_file

    f32 = load_file(make_tiny_model(tmp_path / "f32") / "model.safetensors")
    for dtype in ("bfloat16", "float16"):
        d = make_tiny_model(tmp_path / dtype, dtype=dtype)
        low = load_file(d / "model.safetensors")
        assert low.keys() == f32.keys()
        assert all(torch.equal(f32[k].to(getattr(torch, dtype)), low[k]) for k in f32)
        assert json.loads((d / "config.json").read_text())["torch_dtype"] == dtype
    assert all(t.dtype == torch.float32 for t in f32.values())
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path / "bad", dtype="int8")
