"""fp8 KV caches (float8_e4m3fn and float8_e5m2, per-tensor k/v scales) in tpp_decode on CPU: the
cache vLLM's CPU backend writes is what our views read, vLLM's CPU_ATTN on that cache gives the
oracle's result, and the native kernel on every ISA (fp32 or bf16 queries) and the reference match
the oracle on trees, with the attention variants on top."""
from __future__ import annotations

import pytest
import torch

from vllm_chunkattn.bench.tree_batches import TREE_SPECS, fp8_kv_batch, random_tree_batch
from vllm_chunkattn.kv_layout import kv_cache_views
from vllm_chunkattn.ops.native import native_ops
from vllm_chunkattn.ops.reference import dense_decode_oracle, tpp_decode_reference
from vllm_chunkattn.plan import build_plan

OPS = native_ops(torch.device("cpu"))
needs_op = pytest.mark.skipif(OPS is None, reason="vllm_chunkattn._C not built "
                              "(python setup.py build_ext --inplace)")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALES = (0.37, 1.9)                   # k_scale, v_scale: neither 1, and not each other's
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _batch(seed, fp8_dtype, dtype=torch.float32, heads=(8, 2), block_size=16, layout="flash",
           spec="deep_tree"):
    b = random_tree_batch(seed, **TREE_SPECS[spec], num_heads=heads[0], num_kv_heads=heads[1],
                          head_size=64, block_size=block_size, dtype=torch.float32, layout=layout)
    b.query = (b.query * 4).to(dtype)          # peaky scores: a wrong scale changes the result
    return fp8_kv_batch(b, fp8_dtype, *SCALES, layout=layout)


def _oracle(b, window=0, cap=0.0, sinks=None, scales=SCALES):
    out, lse = dense_decode_oracle(b.query, b.key_cache, b.value_cache, b.block_table,
                                   b.seq_lens, b.scale, window, cap, sinks, *scales)
    return out.float(), lse.float()


def _native(b, plan, window=0, cap=0.0, sinks=None, scales=SCALES, value_cache=None):
    num_seqs, num_heads, head_size = b.query.shape
    slots = max(plan.num_partials, 1)
    ws = (torch.full((slots, num_heads, head_size), float("nan")),
          torch.full((slots, num_heads), float("nan")), torch.full((slots, num_heads), float("nan")))
    out = torch.full(b.query.shape, float("nan"), dtype=b.query.dtype)
    lse = torch.full((num_seqs, num_heads), float("nan"))
    OPS.tpp_decode(b.query, b.key_cache, b.value_cache if value_cache is None else value_cache,
                   b.block_table, b.seq_lens, *plan.tensors(), *ws, b.scale, out, lse, window,
                   cap, sinks, *scales)
    return out.float(), lse


@pytest.mark.parametrize("fp8_dtype", FP8, ids=("e4m3", "e5m2"))
def test_reference_matches_oracle_and_scales_matter(fp8_dtype):
    b = _batch(3, fp8_dtype)
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    out, lse = tpp_decode_reference(b.query, b.key_cache, b.value_cache, b.block_table,
                                    b.seq_lens, plan, b.scale, return_lse=True,
                                    k_scale=SCALES[0], v_scale=SCALES[1])
    ref, ref_lse = _oracle(b)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
    unscaled, unscaled_lse = _oracle(b, scales=(1.0, 1.0))
    assert (unscaled - ref).abs().max() > 0.1 and (unscaled_lse - ref_lse).abs().max() > 0.1


ISAS = ("avx512", "avx2", "scalar")    # the fp32-compute kernels take fp8 KV (any query dtype)


@needs_op
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fp8_dtype", FP8, ids=("e4m3", "e5m2"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("layout", ("flash", "cpu_attn"))
def test_native_matches_oracle(isa, fp8_dtype, dtype, layout, monkeypatch):
    monkeypatch.setenv("CHUNKATTN_CPU_ISA", isa)
    b = _batch(7, fp8_dtype, dtype, heads=(9, 3), layout=layout, block_size=32)
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    sinks = 8 + 2 * torch.randn(9, generator=torch.Generator().manual_seed(1))
    for window, cap, s in ((0, 0.0, None), (23, 3.0, sinks)):
        try:
            out, lse = _native(b, plan, window, cap, s)
        except RuntimeError as e:
            if "no CPU kernel" in str(e):
                pytest.skip(f"this CPU lacks {isa}")
            raise
        ref, ref_lse = _oracle(b, window, cap, s)
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(lse, ref_lse, atol=TOL[dtype], rtol=TOL[dtype])


@needs_op
def test_unread_cache_bytes_are_never_read():
    """0xff (NaN in both formats) in every slot past each sequence and in the unused blocks."""
    b = _batch(9, torch.float8_e4m3fn, layout="cpu_attn", block_size=32)
    ref, ref_lse = _oracle(b)
    read = torch.zeros(b.key_cache.shape[:2], dtype=torch.bool)
    for row, n in zip(b.block_table.tolist(), b.seq_lens.tolist()):
        t = torch.arange(n)
        read[torch.tensor(row)[t // b.block_size], t % b.block_size] = True
    for cache in (b.key_cache, b.value_cache):
        cache.view(torch.uint8)[~read] = 0xFF
    assert int((~read).sum()) > 0
    out, lse = _native(b, build_plan(b.block_table, b.seq_lens, b.block_size))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


@needs_op
def test_bad_scales_and_mixed_dtypes_are_refused():
    b = _batch(1, torch.float8_e4m3fn)
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    for scales in ((0.0, 1.0), (1.0, -2.0), (float("inf"), 1.0)):
        with pytest.raises(RuntimeError, match="k_scale and v_scale must be finite and > 0"):
            _native(b, plan, scales=scales)
    with pytest.raises(RuntimeError, match="value_cache dtype"):
        _native(b, plan, value_cache=b.value_cache.float())


@pytest.mark.vllm
@pytest.mark.parametrize("cache_dtype,fp8_dtype", (("fp8", torch.float8_e4m3fn),
                                                   ("fp8_e5m2", torch.float8_e5m2)))
def test_vllm_cpu_attn_writes_and_reads_what_we_read(cache_dtype, fp8_dtype):
    """K and V written by vLLM's CPU backend into an fp8 cache (its "vec" layout, which CUSTOM
    keeps on AMX machines too), read back through our views, dequantize to K and V; vLLM's
    CPU_ATTN decode over that cache, our native kernel and the oracle agree."""
    pytest.importorskip("vllm")
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        pytest.skip("vLLM's CPU backend writes fp8 only with AVX-512 or AMX")
    from vllm import _custom_ops as vllm_ops
    g = torch.Generator().manual_seed(5)
    num_seqs, num_heads, num_kv_heads, head_size, block_size = 3, 8, 2, 64, 32
    lens = [70, 33, 96]
    num_blocks = 1 + sum(-(-n // block_size) for n in lens)
    table = torch.zeros(num_seqs, 3, dtype=torch.int32)
    slots, ids = [], iter(torch.randperm(num_blocks - 1, generator=g).add(1).tolist())
    for i, n in enumerate(lens):
        for j in range(-(-n // block_size)):
            table[i, j] = next(ids)
        slots += [int(table[i, t // block_size]) * block_size + t % block_size for t in range(n)]
    k = torch.randn(len(slots), num_kv_heads, head_size, generator=g)
    v = torch.randn(len(slots), num_kv_heads, head_size, generator=g)
    kv = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size, dtype=torch.uint8)
    vk, vv = kv.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)
    k_scale, v_scale = 0.02, 0.015
    vllm_ops.cpu_attn_reshape_and_cache(k, v, vk, vv, torch.tensor(slots), "vec",
                                        k_scale=k_scale, v_scale=v_scale,
                                        kv_cache_dtype=cache_dtype)
    key_cache, value_cache = (x.view(fp8_dtype) for x in kv_cache_views(kv, "cpu_attn"))
    slot = torch.tensor(slots)
    got_k = key_cache.float().flatten(0, 1)[slot] * k_scale
    got_v = value_cache.float().flatten(0, 1)[slot] * v_scale
    bits = 3 if fp8_dtype == torch.float8_e4m3fn else 2        # mantissa bits: relative step
    torch.testing.assert_close(got_k, k, rtol=2.0 ** -bits, atol=4 * k_scale * 2.0 ** -9)
    torch.testing.assert_close(got_v, v, rtol=2.0 ** -bits, atol=4 * v_scale * 2.0 ** -9)

    query = 3 * torch.randn(num_seqs, num_heads, head_size, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_size ** -0.5
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    sched = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size,
        seq_lens=seq_lens, dtype=torch.float32, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=-1, isa="vec", enable_kv_split=True)
    theirs = torch.empty_like(query)
    vllm_ops.cpu_attention_with_kv_cache(
        query=query, key_cache=vk, value_cache=vv, output=theirs, query_start_loc=query_start_loc,
        seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=table, softcap=0.0, scheduler_metadata=sched, s_aux=None, k_scale=k_scale,
        v_scale=v_scale, kv_cache_dtype=cache_dtype)
    ref, _ = dense_decode_oracle(query, key_cache, value_cache, table, seq_lens, scale,
                                 k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(theirs, ref.float(), atol=1e-4, rtol=1e-4)
    if OPS is not None:
        plan = build_plan(table, seq_lens, block_size)
        ws = (torch.empty(max(plan.num_partials, 1), num_heads, head_size),
              torch.empty(max(plan.num_partials, 1), num_heads),
              torch.empty(max(plan.num_partials, 1), num_heads))
        ours = torch.empty_like(query)
        OPS.tpp_decode(query, key_cache, value_cache, table, seq_lens, *plan.tensors(), *ws,
                       scale, ours, None, 0, 0.0, None, k_scale, v_scale)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@needs_op
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fp8_dtype", FP8, ids=("e4m3", "e5m2"))
def test_every_fp8_code_reads_as_torch_reads_it(isa, fp8_dtype, monkeypatch):
    """Rows of one token: the output is that token's V row, so each of the 256 codes (NaN codes
    included, subnormals, both zeros) placed in V comes back as torch's conversion of it."""
    monkeypatch.setenv("CHUNKATTN_CPU_ISA", isa)
    num_seqs, head_size, block_size = 4, 64, 32
    codes = torch.arange(256, dtype=torch.uint8).view(num_seqs, head_size)
    kv = torch.zeros(1 + num_seqs, 1, block_size, 2 * head_size, dtype=torch.uint8)
    key_cache, value_cache = (x.view(fp8_dtype) for x in kv_cache_views(kv, "cpu_attn"))
    value_cache.view(torch.uint8)[1:, 0, 0] = codes
    table = torch.arange(1, 1 + num_seqs, dtype=torch.int32)[:, None]
    seq_lens = torch.ones(num_seqs, dtype=torch.int32)
    plan = build_plan(table, seq_lens, block_size)
    query = torch.zeros(num_seqs, 1, head_size)
    out = torch.empty_like(query)
    ws = (torch.empty(1, 1, head_size), torch.empty(1, 1), torch.empty(1, 1))
    try:
        OPS.tpp_decode(query, key_cache, value_cache, table, seq_lens, *plan.tensors(), *ws, 1.0,
                       out, None, 0, 0.0, None, 1.0, 2.0)
    except RuntimeError as e:
        if "no CPU kernel" in str(e):
            pytest.skip(f"this CPU lacks {isa}")
        raise
    expected = codes.view(fp8_dtype).float() * 2.0
    torch.testing.assert_close(out[:, 0], expected, atol=0, rtol=0, equal_nan=True)
