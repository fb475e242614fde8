"""The OpenAI server with --attention-backend CUSTOM: starts, answers /v1/completions and
/metrics, rejects an over-long prompt with vLLM's normal 400, stops. Models whose attention TPP
cannot compute exactly are refused at start-up with a message naming the reason."""
import json
import shutil
import urllib.error
import urllib.request

import pytest

from vllm_runs import tiny_model

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm_chunkattn.serve import ServerError, ServerProcess  # noqa: E402

FLAGS = ["--served-model-name", "tiny", "--dtype", "float32", "--block-size", "32",
         "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20), "--enforce-eager"]


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.status, json.loads(r.read())


def test_server_answers_with_custom_backend():
    with ServerProcess(str(tiny_model()), FLAGS + ["--attention-backend", "CUSTOM"]) as server:
        assert any("ChunkAttention backend (CUSTOM) in use" in ln for ln in server.lines)
        prompt = "you are a helpful assistant " * 20
        status, body = post(server.url + "/v1/completions",
                            {"model": "tiny", "prompt": prompt, "max_tokens": 16,
                             "temperature": 0, "ignore_eos": True})
        assert status == 200
        assert body["usage"]["completion_tokens"] == 16
        assert body["choices"][0]["text"].strip()
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert r.status == 200
        assert "vllm:generation_tokens_total" in metrics
        # Over-long prompt: vLLM's own 400, and the server keeps serving afterwards.
        with pytest.raises(urllib.error.HTTPError) as err:
            post(server.url + "/v1/completions",
                 {"model": "tiny", "prompt": "you " * 2000, "max_tokens": 4})
        assert err.value.code == 400
        status, _ = post(server.url + "/v1/completions",
                         {"model": "tiny", "prompt": prompt, "max_tokens": 2})
        assert status == 200
    assert server.proc.poll() is not None        # stopped


def _model_dir(tmp_path, name, config):
    """A config-only model (weights come from --load-format dummy) with the tiny tokenizer."""
    d = tmp_path / name
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model() / f, d / f)
    (d / "config.json").write_text(json.dumps(config))
    return d


SMALL = dict(vocab_size=2048, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
             torch_dtype="float32")
REFUSED = {
    "sliding window": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=256,
        intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=128, rms_norm_eps=1e-5, **SMALL),
    "ALiBi": dict(
        architectures=["BloomForCausalLM"], model_type="bloom", hidden_size=256, n_layer=1,
        n_head=4, layer_norm_epsilon=1e-5, **SMALL),
}


@pytest.mark.parametrize("reason", list(REFUSED))
def test_inexact_models_are_refused_at_startup(reason, tmp_path):
    model = _model_dir(tmp_path, reason.replace(" ", "_"), REFUSED[reason])
    server = ServerProcess(str(model), FLAGS + ["--attention-backend", "CUSTOM",
                                                "--load-format", "dummy"])
    with pytest.raises(ServerError) as err:
        server.start(timeout_s=300)
    message = str(err.value)
    assert "cannot serve this model exactly" in message
    assert reason.lower() in message.lower()


def test_mla_is_refused_by_backend_selection():
    """MLA through vLLM's real selection path on CPU (a whole MLA model is too big to make)."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from vllm_chunkattn.plugin import register
    register()
    import torch
    config = AttentionSelectorConfig(head_size=128, dtype=torch.float32, kv_cache_dtype="auto",
                                     block_size=32, use_mla=True)
    with pytest.raises(ValueError, match="cannot serve this model exactly: MLA not supported"):
        CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, config)
    plain = config._replace(use_mla=False)
    assert CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, plain).endswith(
        "ChunkAttnBackend")
    # Without the flag the CPU platform still picks vLLM's own backend.
    assert "CPUAttentionBackend" in CpuPlatform.get_attn_backend_cls(None, plain)
