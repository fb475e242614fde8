"""The native CPU TPP kernel (csrc/cpu) against tpp_decode_reference and the fp64 oracle: random
trees over both KV layouts, fp32/fp16/bf16, head sizes, GQA, block sizes, depth and fan-out,
NaN-filled out, lse, batch order, the empty plan, every ISA this CPU has, opcheck, and a cache
written by vLLM's own CPU_ATTN reshape_and_cache. Skipped only when the extension is not built."""
from __future__ import annotations

import itertools

import pytest
import torch

from vllm_chunkattn.kv_layout import kv_cache_views
from vllm_chunkattn.ops.native import native_ops
from vllm_chunkattn.ops.reference import dense_decode_oracle, tpp_decode_reference
from vllm_chunkattn.plan import build_plan, empty_plan
from vllm_chunkattn.bench.tree_batches import TREE_SPECS, random_tree_batch

OPS = native_ops(torch.device("cpu"))
pytestmark = pytest.mark.skipif(OPS is None, reason="vllm_chunkattn._C not built "
                                "(python setup.py build_ext --inplace)")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
HEADS = ((8, 8), (8, 2), (8, 1), (9, 3))


def run_native(b, plan, out_dtype=torch.float32, window=0, cap=0.0, sinks=None):
    """Our kernel with NaN-filled out, lse and workspace: anything it fails to write shows.
    window, cap, sinks: the attention variant (sliding window, soft-cap, sink logits)."""
    num_seqs, num_heads, head_size = b.query.shape
    slots = max(plan.num_partials, 1)
    ws = (torch.full((slots, num_heads, head_size), float("nan")),
          torch.full((slots, num_heads), float("nan")), torch.full((slots, num_heads), float("nan")))
    out = torch.full(b.query.shape, float("nan"), dtype=out_dtype)
    lse = torch.full((num_seqs, num_heads), float("nan"))
    OPS.tpp_decode(b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens,
                   *plan.tensors(), *ws, b.scale, out, lse, window, cap, sinks)
    return out, lse


def reference(b, plan):
    out, lse = tpp_decode_reference(b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens,
                                    plan, b.scale, out=torch.empty(b.query.shape),
                                    return_lse=True)
    return out, lse


def assert_matches_reference(b, plan, dtype):
    out, lse = run_native(b, plan)
    ref, ref_lse = reference(b, plan)
    tol = TOL[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
    return out, lse


# Every spec x layout x dtype; head size, GQA and block size rotate so each value meets each layout.
CASES = [(spec, layout, dtype, (64, 128, 256)[i % 3], HEADS[i % 4], (16, 32, 64)[i // 3 % 3])
         for i, (spec, layout, dtype) in enumerate(itertools.product(TREE_SPECS, ("flash", "cpu_attn"),
                                                                     DTYPES))]


@pytest.mark.parametrize("spec,layout,dtype,head_size,heads,block_size", CASES,
                         ids=[f"{c[0]}-{c[1]}-{str(c[2])[6:]}-d{c[3]}-{c[4][0]}x{c[4][1]}-b{c[5]}"
                              for c in CASES])
def test_matches_reference(spec, layout, dtype, head_size, heads, block_size):
    b = random_tree_batch(len(spec), **TREE_SPECS[spec], num_heads=heads[0], num_kv_heads=heads[1],
                          head_size=head_size, block_size=block_size, dtype=dtype, layout=layout)
    assert_matches_reference(b, build_plan(b.block_table, b.seq_lens, block_size), dtype)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("head_size", (64, 128, 256))
def test_gqa_and_head_sizes_bf16(heads, head_size):
    """The bf16 kernel's row tiling (8 + 4 + 2 + 1 rows) over every group size."""
    block_size = (16, 32, 64)[(HEADS.index(heads) + head_size // 64) % 3]
    b = random_tree_batch(head_size + block_size, **TREE_SPECS["system_prompts"],
                          num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
                          block_size=block_size, dtype=torch.bfloat16, layout="cpu_attn")
    assert_matches_reference(b, build_plan(b.block_table, b.seq_lens, block_size), torch.bfloat16)


@pytest.mark.parametrize("depth,fanout", [(1, 8), (2, 8), (3, 5), (4, 3), (4, 1)])
@pytest.mark.parametrize("layout", ("flash", "cpu_attn"))
def test_tree_shapes(depth, fanout, layout):
    b = random_tree_batch(depth * 10 + fanout, depth=depth, fanout=fanout, max_node_blocks=3,
                          max_private_blocks=2, num_heads=8, num_kv_heads=2, head_size=64,
                          block_size=16, dtype=torch.bfloat16, layout=layout)
    assert_matches_reference(b, build_plan(b.block_table, b.seq_lens, 16), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_against_fp64_oracle(dtype):
    b = random_tree_batch(7, **TREE_SPECS["deep_tree"], dtype=dtype, layout="cpu_attn")
    out, lse = run_native(b, build_plan(b.block_table, b.seq_lens, b.block_size))
    ref, ref_lse = dense_decode_oracle(b.query, b.key_cache, b.value_cache, b.block_table,
                                       b.seq_lens, b.scale)
    tol = TOL[dtype] * 10 if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(out, ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ("flash", "cpu_attn"))
def test_empty_plan_is_paged_decode(dtype, layout):
    b = random_tree_batch(3, **TREE_SPECS["system_prompts"], dtype=dtype, layout=layout)
    out, lse = run_native(b, empty_plan(b.query.shape[0]))
    ref, ref_lse = dense_decode_oracle(b.query, b.key_cache, b.value_cache, b.block_table,
                                       b.seq_lens, b.scale)
    tol = TOL[dtype] * 10 if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(out, ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_out_dtype_is_the_fp32_result_rounded(dtype):
    b = random_tree_batch(5, **TREE_SPECS["deep_tree"], dtype=dtype, layout="cpu_attn")
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    out32, lse32 = run_native(b, plan)
    out, lse = run_native(b, plan, out_dtype=dtype)
    assert torch.equal(out, out32.to(dtype)) and torch.equal(lse, lse32)


@pytest.mark.parametrize("spec", ("system_prompts", "deep_tree", "batch_17"))
def test_batch_order_invariance(spec):
    b = random_tree_batch(11, **TREE_SPECS[spec], dtype=torch.bfloat16, layout="cpu_attn")
    out, lse = run_native(b, build_plan(b.block_table, b.seq_lens, b.block_size))
    perm = torch.randperm(b.query.shape[0], generator=torch.Generator().manual_seed(0))
    b.query, b.block_table, b.seq_lens = b.query[perm], b.block_table[perm], b.seq_lens[perm]
    out_p, lse_p = run_native(b, build_plan(b.block_table, b.seq_lens, b.block_size))
    assert torch.equal(out_p, out[perm]) and torch.equal(lse_p, lse[perm])


def _cpu_has(isa: str) -> bool:
    if isa == "amx":   # the kernel also needs the OS's permission: a refusal skips via the error
        return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    caps = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}
    have = caps.get(torch.backends.cpu.get_cpu_capability(), 2)
    return have >= {"scalar": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 2}[isa]


ISAS = ("amx", "avx512_bf16", "avx512", "avx2", "scalar")
# The bf16 kernels (amx, avx512_bf16) take bf16 KV and query only; every other ISA takes every dtype.
ISA_DTYPES = [(isa, dtype) for isa in ISAS for dtype in DTYPES
              if isa not in ("amx", "avx512_bf16") or dtype == torch.bfloat16]


@pytest.mark.parametrize("isa,dtype", ISA_DTYPES, ids=[f"{i}-{str(d)[6:]}" for i, d in ISA_DTYPES])
def test_every_isa(isa, dtype, monkeypatch):
    """The run-time dispatch's fallbacks, forced on this CPU (the op reads CHUNKATTN_CPU_ISA)."""
    if not _cpu_has(isa):
        pytest.skip(f"this CPU lacks {isa}")
    monkeypatch.setenv("CHUNKATTN_CPU_ISA", isa)
    for i, layout in enumerate(("flash", "cpu_attn")):
        b = random_tree_batch(i, **TREE_SPECS["batch_17"], num_heads=9, num_kv_heads=3,
                              head_size=(64, 128)[i], block_size=(16, 32)[i], dtype=dtype,
                              layout=layout)
        try:
            assert_matches_reference(b, build_plan(b.block_table, b.seq_lens, b.block_size), dtype)
        except RuntimeError as e:
            if "no CPU kernel" in str(e) and "CHUNKATTN_CPU_ISA" in str(e):
                pytest.skip(f"this CPU lacks {isa}")
            raise


@pytest.mark.parametrize("isa", ("", "amx", "avx512_bf16"))
@pytest.mark.parametrize("head_size,block_size", [(64, 16), (128, 64), (256, 32)])
def test_many_rows_long_nodes(isa, head_size, block_size, monkeypatch):
    """Chunk-first at GEMM scale: ~100 rows per node (several row blocks plus a remainder) over
    nodes of up to ~1300 tokens (several packed chunks, a partial last key tile)."""
    if isa and not _cpu_has(isa):
        pytest.skip(f"this CPU lacks {isa}")
    if isa:
        monkeypatch.setenv("CHUNKATTN_CPU_ISA", isa)
    b = random_tree_batch(head_size, fanouts=[1, 2, 19], max_node_blocks=1300 // block_size // 2,
                          max_private_blocks=1, num_heads=9, num_kv_heads=3, head_size=head_size,
                          block_size=block_size, dtype=torch.bfloat16, layout="cpu_attn")
    try:
        assert_matches_reference(b, build_plan(b.block_table, b.seq_lens, block_size), torch.bfloat16)
    except RuntimeError as e:
        if isa and "no CPU kernel" in str(e):
            pytest.skip(f"this CPU lacks {isa}")
        raise


def test_rejects_bad_arguments():
    b = random_tree_batch(0, **TREE_SPECS["batch_1"], layout="cpu_attn")
    plan = empty_plan(b.query.shape[0])
    b.key_cache = b.key_cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)[..., ::2]
    with pytest.raises(RuntimeError, match="key_cache"):
        run_native(b, plan)
    b = random_tree_batch(0, **TREE_SPECS["batch_1"], head_size=72, layout="flash")
    with pytest.raises(RuntimeError, match="head_size 72"):
        run_native(b, plan)
    b = random_tree_batch(0, **TREE_SPECS["batch_1"], layout="flash")
    b.block_table = b.block_table.clone()
    b.block_table[0, 0] = 10 ** 6
    with pytest.raises(RuntimeError, match="block_table"):
        run_native(b, plan)
    b = random_tree_batch(0, **TREE_SPECS["batch_1"], layout="flash")
    for scale in (0.0, -0.125, float("nan"), float("inf")):  # the contract every device shares
        b.scale = scale
        with pytest.raises(RuntimeError, match="scale must be positive and finite"):
            run_native(b, plan)


@pytest.mark.parametrize("spec,dtype", [("system_prompts", torch.bfloat16),
                                        ("deep_tree", torch.float32)])
def test_opcheck(spec, dtype):
    b = random_tree_batch(1, **TREE_SPECS[spec], dtype=dtype, layout="cpu_attn")
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    num_seqs, num_heads, head_size = b.query.shape
    slots = max(plan.num_partials, 1)
    args = (b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens,
            *plan.tensors(),
            torch.zeros(slots, num_heads, head_size), torch.zeros(slots, num_heads),
            torch.zeros(slots, num_heads), b.scale, torch.empty_like(b.query),
            torch.empty(num_seqs, num_heads))
    torch.library.opcheck(torch.ops.chunkattn.tpp_decode.default, args)


@pytest.mark.vllm
@pytest.mark.parametrize("block_size,isa", [(16, "vec16"), (32, "vec"), (64, "vec")])
def test_reads_cache_written_by_vllm(block_size, isa):
    """vLLM's CPU_ATTN writes the cache (views made exactly as cpu_attn.py makes them); we read it
    in place and agree with the oracle on the K/V it was given, and with CPU_ATTN's own decode."""
    pytest.importorskip("vllm")
    from vllm import _custom_ops as vllm_ops
    b = random_tree_batch(block_size, **TREE_SPECS["system_prompts"], num_heads=8, num_kv_heads=2,
                          head_size=128, block_size=block_size, dtype=torch.bfloat16,
                          layout="cpu_attn")
    num_blocks, num_kv_heads, _, two_d = b.kv_cache.shape
    # Ground-truth K/V per slot, written through vLLM into a fresh cache.
    key = torch.randn(num_blocks * block_size, num_kv_heads, two_d // 2).to(torch.bfloat16)
    value = torch.randn_like(key)
    kv_cache = torch.zeros_like(b.kv_cache)
    vk, vv = kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)
    vllm_ops.cpu_attn_reshape_and_cache(key, value, vk, vv, torch.arange(key.shape[0]), isa)
    b.kv_cache = kv_cache
    b.key_cache, b.value_cache = kv_cache_views(kv_cache, "cpu_attn")
    assert torch.equal(b.key_cache.flatten(0, 1), key) and torch.equal(b.value_cache.flatten(0, 1), value)
    out, lse = run_native(b, build_plan(b.block_table, b.seq_lens, block_size))
    ref, ref_lse = dense_decode_oracle(b.query, b.key_cache, b.value_cache, b.block_table,
                                       b.seq_lens, b.scale)
    torch.testing.assert_close(out, ref.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-2, rtol=1e-2)
    # CPU_ATTN's own decode on the same cache, called as vllm/v1/attention/backends/cpu_attn.py does.
    num_seqs, num_heads, head_size = b.query.shape
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    sched = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size,
        seq_lens=b.seq_lens, dtype=torch.bfloat16, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=True)
    theirs = torch.empty_like(b.query)
    vllm_ops.cpu_attention_with_kv_cache(
        query=b.query, key_cache=vk, value_cache=vv, output=theirs, query_start_loc=query_start_loc,
        seq_lens=b.seq_lens, scale=b.scale, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=b.block_table, softcap=0, scheduler_metadata=sched, s_aux=None)
    torch.testing.assert_close(out.to(torch.bfloat16).float(), theirs.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout,block_size", [("cpu_attn", 64), ("cpu_attn", 16), ("flash", 32)])
def test_cache_past_seq_len_never_read_into_results(dtype, layout, block_size):
    """Slots past a row's seq_len in its last block hold NaN (vLLM never clears freed slots): the
    kernel reads whole tiles in place (fp32, CPU_ATTN layout) but must mask them out exactly."""
    b = random_tree_batch(11, **TREE_SPECS["system_prompts"], dtype=dtype, layout=layout,
                          block_size=block_size)
    table = b.block_table.tolist()
    poisoned = 0
    for i, n in enumerate(b.seq_lens.tolist()):
        last, used = table[i][(n - 1) // block_size], n % block_size
        if used and sum(row.count(last) for row in table) == 1:
            b.key_cache[last, used:] = float("nan")
            b.value_cache[last, used:] = float("nan")
            poisoned += 1
    assert poisoned, "the batch has no partly filled private block to poison"
    out, lse = assert_matches_reference(b, build_plan(b.block_table, b.seq_lens, block_size), dtype)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
