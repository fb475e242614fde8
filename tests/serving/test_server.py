"""The OpenAI server with --attention-backend CUSTOM: starts, answers /v1/completions and
/metrics (vLLM's metrics and the chunkattn:* sharing metrics, with no set-up), rejects an
over-long prompt with vLLM's normal 400, stops. Models whose attention TPP cannot compute exactly
are refused at start-up with a message naming the reason: where the config is built when the
config shows it (no engine starts), else by the worker's attention layers."""
import json
import re
import shutil
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_runs import assert_native_kernel, cpu_writes_fp8, tiny_model

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm_chunkattn.bench.server_process import ServerError, ServerProcess  # noqa: E402

FLAGS = ["--served-model-name", "tiny", "--dtype", "float32", "--block-size", "32",
         "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20), "--enforce-eager"]


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.status, json.loads(r.read())


@pytest.fixture(scope="module")
def custom_server():
    server = ServerProcess(str(tiny_model()), FLAGS + ["--attention-backend", "CUSTOM"])
    for name in ("PROMETHEUS_MULTIPROC_DIR", "CHUNKATTN_METRICS_DIR"):
        server.env.pop(name, None)            # /metrics must need no environment at all
    with server:
        assert_native_kernel(server.lines)    # start-up lines: still in the kept tail
        yield server
    assert server.proc.poll() is not None        # stopped


def scrape(server) -> dict[str, float]:
    """Sample name -> value, summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        assert r.status == 200
        text = r.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def test_server_answers_with_custom_backend(custom_server):
    server = custom_server
    prompt = "you are a helpful assistant " * 20
    status, body = post(server.url + "/v1/completions",
                        {"model": "tiny", "prompt": prompt, "max_tokens": 16,
                         "temperature": 0, "ignore_eos": True})
    assert status == 200
    assert body["usage"]["completion_tokens"] == 16
    assert body["choices"][0]["text"].strip()
    assert "vllm:generation_tokens_total" in scrape(server)
    # Over-long prompt: vLLM's own 400, and the server keeps serving afterwards.
    with pytest.raises(urllib.error.HTTPError) as err:
        post(server.url + "/v1/completions",
             {"model": "tiny", "prompt": "you " * 2000, "max_tokens": 4})
    assert err.value.code == 400
    status, _ = post(server.url + "/v1/completions",
                     {"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert status == 200


SHARING_METRICS = ["chunkattn:decode_kv_tokens_total", "chunkattn:decode_shared_kv_tokens_total",
                   "chunkattn:kv_saved_tokens", "chunkattn:chunks_in_use",
                   "chunkattn:chunks_cached", "chunkattn:chunks_free",
                   "chunkattn:chunk_evictions_total", "chunkattn:preemptions_total"]


def test_metrics_show_sharing_with_no_setup(custom_server):
    server = custom_server
    system = "you are a helpful assistant that answers briefly " * 12   # a few shared chunks
    bodies = [{"model": "tiny", "prompt": system + f"question {i}", "max_tokens": 24,
               "temperature": 0, "ignore_eos": True} for i in range(3)]
    bodies.append({**bodies[0], "n": 3, "temperature": 1.0, "seed": 0})   # 3 rows, one prompt
    with ThreadPoolExecutor(len(bodies)) as pool:       # concurrent: they decode together
        assert [s for s, _ in pool.map(lambda b: post(server.url + "/v1/completions", b),
                                       bodies)] == [200] * len(bodies)
    m = scrape(server)
    missing = [name for name in SHARING_METRICS if name not in m]
    assert not missing, missing
    assert m["chunkattn:decode_shared_kv_tokens_total"] > 0, m
    assert m["chunkattn:decode_kv_tokens_total"] > m["chunkattn:decode_shared_kv_tokens_total"]
    # Every request has finished: no chunk in use, so none shared; the prompts stay cached.
    assert m["chunkattn:chunks_in_use"] == m["chunkattn:kv_saved_tokens"] == 0, m
    assert m["chunkattn:chunks_cached"] > 0, m
    assert "vllm:generation_tokens_total" in m         # vLLM's own metrics are still there


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
MODELS = {
    "mistral": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=256,
        intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=128, rms_norm_eps=1e-5, **SMALL),
    "mistral-hd80": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=320,
        intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=80, sliding_window=None, rms_norm_eps=1e-5, **SMALL),
    "bloom": dict(
        architectures=["BloomForCausalLM"], model_type="bloom", hidden_size=256, n_layer=1,
        n_head=4, layer_norm_epsilon=1e-5, **SMALL),
    # Sliding layers interleaved with full ones, and a soft cap on the attention logits.
    "gemma2": dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=256,
        intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=128, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=64, rms_norm_eps=1e-6, **SMALL),
    "deepseek_v2": dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=256,
        intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None,
        qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, rms_norm_eps=1e-6,
        **SMALL),
    "whisper": dict(
        architectures=["WhisperForConditionalGeneration"], model_type="whisper", d_model=256,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=512, decoder_ffn_dim=512, num_mel_bins=80, max_source_positions=1500,
        max_target_positions=448, decoder_start_token_id=1, pad_token_id=0,
        is_encoder_decoder=True, **SMALL),
}


@pytest.mark.parametrize("reason, model, flags, where", [
    # the config shows it: no engine starts
    ("fp8 KV cache with head size 80", "mistral-hd80", ["--kv-cache-dtype", "fp8"], "config"),
    ("ALiBi", "bloom", [], "worker"),           # model code: the attention layers refuse it
])
def test_inexact_models_are_refused_at_startup(reason, model, flags, where, tmp_path):
    server = ServerProcess(str(_model_dir(tmp_path, model, MODELS[model])),
                           FLAGS + flags + ["--attention-backend", "CUSTOM", "--load-format",
                                            "dummy"])
    with pytest.raises(ServerError) as err:
        server.start(timeout_s=300)
    root_cause = str(err.value).splitlines()[0]         # the error ServerProcess found first
    assert "cannot serve this model exactly" in root_cause, err.value
    assert reason.lower() in root_cause.lower(), err.value
    engine_started = any("EngineCore" in line for line in server.lines)
    assert engine_started == (where == "worker"), server.tail()


def _engine_config(model, **engine_args):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_chunkattn.plugin import register
    register()
    engine_args = {"max_model_len": 512, **engine_args}
    return EngineArgs(model=str(model), load_format="dummy", dtype="float32",
                      **engine_args).create_engine_config()


# A drafter model (here the tiny model drafting for itself): its layers are not served.
DRAFT_MODEL = {"method": "draft_model", "model": str(tiny_model()), "num_speculative_tokens": 2}


@pytest.mark.parametrize("model, engine_args, reason", [
    ("deepseek_v2", {}, "cannot serve this model exactly: MLA"),
    ("whisper", {"max_model_len": 448},
     "cannot serve this model exactly: encoder-decoder attention"),
    (None, {"kv_cache_dtype": "fp8_inc"},
     "cannot serve this model exactly: quantized KV cache (fp8_inc)"),
    ("mistral-hd80", {"kv_cache_dtype": "fp8"},
     "cannot serve this model exactly: an fp8 KV cache with head size 80 (vLLM's CPU backend "
     "writes fp8 for head sizes divisible by 32)"),
    (None, {"speculative_config": DRAFT_MODEL},
     "cannot serve this model exactly: speculative decoding with method 'draft_model' "
     "(served: 'ngram', 'eagle')"),
])
def test_what_the_config_shows_is_refused_where_the_config_is_built(model, engine_args, reason,
                                                                    tmp_path):
    """The API server (or the user's LLM()) refuses before any engine or worker starts; the
    same config without the flag is vLLM's to serve."""
    path = _model_dir(tmp_path, model, MODELS[model]) if model else tiny_model()
    with pytest.raises(ValueError, match=re.escape(reason)):
        _engine_config(path, attention_backend="CUSTOM", **engine_args)
    _engine_config(path, **engine_args)


def test_a_config_without_a_model_is_checked_for_what_it_has():
    """vLLM's own tests build configs with no model: the tree is still installed, and only what
    the config holds (here the KV cache's dtype) is checked."""
    from vllm.config import AttentionConfig, CacheConfig, VllmConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_chunkattn.plugin import SCHEDULER_PATH, register
    register()
    custom = AttentionConfig(backend=AttentionBackendEnum.CUSTOM)
    assert VllmConfig(attention_config=custom).scheduler_config.scheduler_cls == SCHEDULER_PATH
    with pytest.raises(ValueError, match=re.escape("quantized KV cache (fp8_inc)")):
        VllmConfig(attention_config=custom, cache_config=CacheConfig(cache_dtype="fp8_inc"))
    if cpu_writes_fp8():
        VllmConfig(attention_config=custom, cache_config=CacheConfig(cache_dtype="fp8"))
    else:       # where vLLM's CPU backend cannot write fp8, the reason
        with pytest.raises(ValueError, match=re.escape("an fp8 KV cache on a CPU without "
                                                       "AVX-512 or AMX")):
            VllmConfig(attention_config=custom, cache_config=CacheConfig(cache_dtype="fp8"))


def test_the_models_we_serve_are_not_refused(tmp_path):
    """No refusal where the layers would accept: the Qwen2 configs carry a sliding_window that
    their use_sliding_window=false turns off; each gets the tree as its KV cache manager. Full
    and windowed layers (gpt-oss, Gemma 2/3) keep vLLM's hybrid KV cache groups, as stock does,
    except with KV events; a window on every layer (Mistral) gets one KV cache group."""
    from vllm.config import KVEventsConfig

    from vllm_chunkattn.bench.model_shapes import SHAPES, make_shape_model
    from vllm_chunkattn.plugin import ASYNC_SCHEDULER_PATH, SCHEDULER_PATH
    models = [tiny_model()] + [make_shape_model(name, tmp_path / name) for name in SHAPES]
    for model in models:
        config = _engine_config(model, attention_backend="CUSTOM")
        assert config.scheduler_config.scheduler_cls in (SCHEDULER_PATH, ASYNC_SCHEDULER_PATH)
        assert config.scheduler_config.disable_hybrid_kv_cache_manager is False, model.name
        if model.name in ("gpt-oss-20b", "gemma-3-1b"):
            events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
            config = _engine_config(model, attention_backend="CUSTOM", kv_events_config=events)
            assert config.scheduler_config.disable_hybrid_kv_cache_manager is True, model.name
    dirs = {name: _model_dir(tmp_path, name, MODELS[name]) for name in ("mistral", "gemma2")}
    cases = [("mistral", {}, True), ("gemma2", {}, False)]
    if cpu_writes_fp8():        # (elsewhere refused, test_a_config_without_a_model...)
        cases.append(("mistral", {"kv_cache_dtype": "fp8"}, True))
    for name, engine_args, one_group in cases:
        config = _engine_config(dirs[name], attention_backend="CUSTOM", **engine_args)
        assert config.scheduler_config.disable_hybrid_kv_cache_manager is one_group, name


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


def test_a_second_start_is_refused_and_orphans_nothing():
    """`with ServerProcess(...) as s: s.start()` must not start a second server and leave the
    first running after the block."""
    import subprocess
    import sys

    server = ServerProcess("unused-model", [])
    server.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                   start_new_session=True)     # stands in for a running server
    first = server.proc
    try:
        with pytest.raises(ServerError, match="already running; stop"):
            server.start()
        assert server.proc is first and first.poll() is None
    finally:
        server.stop(timeout_s=5)
    assert first.poll() is not None
