"""The support matrix has one home (plugin/support.py): the README shows its table as generated,
and what the table says is refused is what the refusals refuse."""
import re
from pathlib import Path

import torch
from vllm.v1.attention.backend import AttentionType

from vllm_chunkattn.plugin import support
from vllm_chunkattn.plugin.backend import ChunkAttnBackend

README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN, END = "<!-- support-matrix:begin -->", "<!-- support-matrix:end -->"


def test_the_readme_shows_the_generated_support_matrix():
    text = README.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "the README lost its markers"
    shown = text.split(BEGIN)[1].split(END)[0].strip()
    assert shown == support.markdown().strip(), (
        "README's support matrix differs from plugin/support.py's: regenerate it with "
        "`python -m vllm_chunkattn.plugin.support` and paste it between the markers")


def test_the_layer_refusals_name_each_refused_kind_of_attention():
    assert support.layer_refusals() == []
    reasons = support.layer_refusals(alibi_slopes=[1.0], attn_type=AttentionType.ENCODER_DECODER,
                                     kv_cache_dtype="fp8_inc")
    assert reasons == ["ALiBi position biases",
                       "encoder-decoder attention (only decoder self-attention is supported)",
                       "quantized KV cache (fp8_inc)"]
    assert "exactly: ALiBi" in str(support.refusal(reasons[:1]))


def test_fp8_kv_caches_are_served_on_cpus_vllm_writes_them_on(monkeypatch):
    # A CPU with AVX-512 whatever this machine has; without it, below.
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)
    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert support.layer_refusals(kv_cache_dtype=dtype, head_size=128) == []
        assert support.layer_refusals(kv_cache_dtype=dtype, head_size=128, is_cpu=False) == [
            f"quantized KV cache ({dtype} on a GPU)"]
    assert support.layer_refusals(kv_cache_dtype="fp8", head_size=80) == [
        "an fp8 KV cache with head size 80 (vLLM's CPU backend writes fp8 for head sizes "
        "divisible by 32)"]
    assert support.layer_refusals(kv_cache_dtype="fp8", head_size=64, block_size=16) == [
        "an fp8 KV cache with block size 16 (vLLM's CPU backend keeps fp8 in blocks of a "
        "multiple of 32 tokens)"]
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert support.layer_refusals(kv_cache_dtype="fp8_e5m2", head_size=64) == [
        "an fp8_e5m2 KV cache on a CPU without AVX-512 or AMX (vLLM's CPU backend writes fp8 "
        "only there)"]


def test_the_table_states_the_backends_own_limits():
    table = support.markdown()
    sizes = ChunkAttnBackend.get_supported_head_sizes()      # this machine's platform: CPU
    assert f"head size {' / '.join(map(str, sizes))} on CPU" in table
    assert f"{' / '.join(map(str, support.CUDA_HEAD_SIZES))} on GPU" in table
    assert set(ChunkAttnBackend.supported_kv_cache_dtypes) == {
        *support.KV_CACHE_DTYPES, "fp8", "fp8_e4m3", "fp8_e5m2"}
    served = [what for what, ok, _ in support.MATRIX if ok]
    refused = [what for what, ok, _ in support.MATRIX if not ok]
    for kind in ("sliding window", "attention sinks", "soft-capping"):
        assert any(kind in what for what in served), kind
    assert any("fp8 KV cache" in what and "CPUs" in what for what in served)
    for kind in ("ALiBi", "chunked local attention", "MLA", "fp8 KV cache on GPUs",
                 "speculative decoding", "KV connectors"):
        assert any(kind in what for what in refused), kind
    assert any("KV cache events" in what for what in served)
    assert re.search(r"the kernel needs \d+ bytes", table)
