"""bench kernel on a windowed, soft-capped layer with sinks: ours and vLLM's CPU_ATTN get the same
variant and must agree before anything is timed (the bench stops otherwise)."""
import pytest

from vllm_chunkattn.bench.contenders import Variant
from vllm_chunkattn.bench.kernel import main as kernel_main
from vllm_chunkattn.ops.native import native_ops
from vllm_runs import NEEDS_CPU_FP8

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(native_ops("cpu") is None, reason="vllm_chunkattn._C not built")]


def test_variant_labels():
    assert Variant().label() == "full causal attention"
    assert Variant(128, 0.0, True).label() == "window 128, sinks"


def test_bench_kernel_times_a_windowed_layer_with_sinks(tmp_path, capsys):
    pytest.importorskip("vllm")
    # fp32: CPU_ATTN's vec kernel, whose output the bench compares with ours (AMX's is not).
    assert kernel_main(["--quick", "--reps", "1", "--dtype", "float32", "--sliding-window", "100",
                        "--soft-cap", "30", "--sinks", "--out", str(tmp_path)]) == 0
    stem = tmp_path / "kernel_cpu_fp32_w100_cap30_sinks"
    text = stem.with_suffix(".md").read_text()
    assert "One layer (window 100, soft-cap 30, sinks)" in text
    assert stem.with_suffix(".png").exists()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("device=")]
    assert len(rows) == 8 and all("ours_vs_cpu_attn=" in r for r in rows)


@NEEDS_CPU_FP8
def test_bench_kernel_times_an_fp8_kv_cache(tmp_path, capsys):
    pytest.importorskip("vllm")
    assert Variant(kv_cache_dtype="fp8_e5m2").label() == "full causal attention, fp8_e5m2 KV cache"
    assert kernel_main(["--quick", "--reps", "1", "--dtype", "float32", "--kv-cache-dtype", "fp8",
                        "--out", str(tmp_path)]) == 0
    stem = tmp_path / "kernel_cpu_fp32_fp8"
    assert "One layer (full causal attention, fp8 KV cache)" in stem.with_suffix(".md").read_text()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("device=")]
    # the quick grid's block-64 points (vLLM keeps fp8 caches in blocks of 32k only)
    assert len(rows) == 4 and all("ours_vs_cpu_attn=" in r and "block=64" in r for r in rows)
