"""The CUDA TPP kernel over fp8 KV caches (float8_e4m3fn / float8_e5m2 views of vLLM's uint8
cache, per-tensor k_scale / v_scale) run on the CPU through the SIMT emulation
(test_cuda_simt_emulation.py says what it checks), against the fp64 dense oracle. The kernel
stages the fp8 bytes with cp.async and converts each stage to the query's fp16 / bf16 in shared
memory; the emulation converts through c10's fp8 types, independently of the kernel's
tpp_ptx.cuh. Shared memory starts as 0xff bytes, a NaN in both formats, so a byte converted
before its copy landed poisons the result; so do the cache's unread rows, set to 0x7f (NaN)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from vllm_chunkattn.bench.cuda_work import split_spare_slots
from vllm_chunkattn.bench.tree_batches import (TC_LSE_TOL, TC_TOL, fp8_kv_batch, named_tree,
                                               padded_to_capacity, poison_unread_kv, random_tree_batch)
from vllm_chunkattn.ops import cuda_fit
from vllm_chunkattn.ops.reference import dense_decode_oracle
from vllm_chunkattn.plan import build_plan

from test_cuda_simt_emulation import run
from test_cuda_variants_emulation import LONG, SHARED, WIDE, sinks_for, window_cases

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
SCALES = dict(k_scale=0.37, v_scale=1.9)     # neither 1, nor each other's


def oracle(b, **kw):
    return dense_decode_oracle(b.query, b.key_cache, b.value_cache, b.block_table, b.seq_lens,
                               b.scale, **kw)


def fp8_batch(seed, fp8, dtype, tree=SHARED, heads=(8, 2), head_size=64, variant=None,
              poison=False, **kw):
    """A random tree batch of `dtype` queries whose KV is an fp8 cache holding K / k_scale and
    V / v_scale, and the oracle's (out, lse) for it under `variant` (the op's sliding_window,
    soft_cap, sinks). poison: every cache row no sequence reads (in the variant's window) holds
    fp8 NaN (0x7f); the oracle's results are those of the batch before."""
    variant = variant or {}
    b = random_tree_batch(seed, **tree, num_heads=heads[0], num_kv_heads=heads[1],
                          head_size=head_size, dtype=dtype, **kw)
    b.query = b.query * 2                        # peakier scores: the scales matter more
    expect = oracle(fp8_kv_batch(b, fp8, **SCALES), **variant, **SCALES)
    if poison:
        assert poison_unread_kv(b, variant.get("sliding_window", 0)) > 0
    b = fp8_kv_batch(b, fp8, **SCALES)
    if poison:
        assert (b.key_cache.view(torch.uint8) == 0x7f).any()
    return b, expect


def check(b, out, lse, expect):
    ref, ref_lse = expect
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), ref, **TC_TOL[b.query.dtype])
    torch.testing.assert_close(lse.double(), ref_lse, **TC_LSE_TOL[b.query.dtype])


def plan_of(b):
    return build_plan(b.block_table, b.seq_lens, b.block_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", FP8)
def test_shared_nodes_and_private_tails(emu, fp8, dtype):
    b, expect = fp8_batch(0, fp8, dtype, poison=True)
    plan = plan_of(b)
    assert plan.num_nodes >= 2 and (plan.seq_num_shared_blocks * b.block_size < b.seq_lens).any()
    check(b, *run(emu, b, plan, **SCALES), expect)
    # The scales reach the result: without them the oracle is far from it.
    unscaled = fp8_batch(0, fp8, dtype)[0]
    out, lse = oracle(unscaled)
    assert (out - expect[0]).abs().max() > 0.2 and (lse - expect[1]).abs().max() > 0.2


@pytest.mark.parametrize("stage", ["default", "compact"])
@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
@pytest.mark.parametrize("fp8", FP8)
def test_every_head_size_over_several_stages(emu, monkeypatch, fp8, head_size, stage):
    # Long nodes and tails: the cp.async double buffer of fp8 stages turns over; head 96's
    # copies move from chunk to chunk (StageChunks), and its conversion must follow them.
    tokens = "32" if stage == "compact" else "64"
    monkeypatch.setenv("CHUNKATTN_PARTIAL_STAGE_TOKENS", tokens)
    monkeypatch.setenv("CHUNKATTN_FINAL_STAGE_TOKENS", tokens)
    dtype = torch.float16 if head_size in (64, 256) else torch.bfloat16
    b, expect = fp8_batch(1, fp8, dtype, tree=named_tree("long"), head_size=head_size, poison=True)
    assert max(b.seq_lens.tolist()) > 4 * 64
    check(b, *run(emu, b, plan_of(b), **SCALES), expect)
    if stage == "default":     # fp8 stages live in the 16-bit stages' smem: the same launch
        assert emu.last_launch()[2] == cuda_fit.PARTIAL_SMEM_BYTES[head_size]


@pytest.mark.parametrize("at_issue", [False, True])
@pytest.mark.parametrize("fp8", FP8)
def test_window_soft_cap_and_sinks_over_splits(emu, splits, fp8, at_issue):
    # Shared nodes whose sharers' window edges fall inside them, tails, forced KV splits; the
    # cap's tanh takes the score with k_scale in it.
    window = 150
    variant = dict(sliding_window=window, soft_cap=6.0, sinks=sinks_for(8, 1))
    b, expect = fp8_batch(3, fp8, torch.bfloat16, tree=LONG, variant=variant, poison=True)
    plan = plan_of(b)
    assert {"in_node", "in_tail"} <= window_cases(b, plan, window)
    splits(3, 2)
    spare = split_spare_slots(plan, b.query.shape[0], 3, 2)
    check(b, *run(emu, b, plan, spare_slots=spare, at_issue=at_issue, **variant, **SCALES),
          expect)


@pytest.mark.parametrize("heads", [(16, 2), (9, 3)])
@pytest.mark.parametrize("fp8", FP8)
def test_gqa_sharers_with_their_own_edges(emu, fp8, heads):
    # Chunk CTAs of 64 and 63 rows (8 sharers x 8 q heads, 21 x 3), each sharer its own edge.
    window = 30
    variant = dict(sliding_window=window, soft_cap=10.0, sinks=sinks_for(heads[0], 2))
    b, expect = fp8_batch(5, fp8, torch.float16, tree=WIDE, heads=heads, variant=variant,
                          poison=True)
    plan = plan_of(b)
    assert "in_node" in window_cases(b, plan, window)
    check(b, *run(emu, b, plan, **variant, **SCALES), expect)


def finite_codes(fp8, max_abs: float) -> torch.Tensor:
    """Every byte that is a finite value of `fp8` no larger than max_abs: zeros, subnormals,
    normals, both signs."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(fp8).float()
    return codes[values.isfinite() & (values.abs() <= max_abs)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", FP8)
def test_every_code_of_the_format(emu, fp8, dtype):
    # Bytes drawn from every finite code up to 7.5 (e4m3: 160 of 256, e5m2: 144), so subnormals,
    # -0 and each exponent are all read: the conversion must be exact for each.
    b, _ = fp8_batch(6, fp8, dtype)
    codes = finite_codes(fp8, 7.5)
    assert codes.numel() == (160 if fp8 == torch.float8_e4m3fn else 144)
    assert (codes.view(fp8).float() == 0).sum() == 2                     # +0 and -0
    g = torch.Generator().manual_seed(6)
    b.kv_cache.copy_(codes[torch.randint(codes.numel(), b.kv_cache.shape, generator=g)])
    assert torch.equal(torch.unique(b.value_cache.view(torch.uint8)), torch.sort(codes).values)
    check(b, *run(emu, b, plan_of(b), **SCALES), oracle(b, **SCALES))


@pytest.mark.parametrize("fp8", FP8)
def test_a_padded_plan(emu, fp8):
    # A captured graph's plan: padded rows (seq_len 0) come out 0, v_scale or not, lse = the sink.
    b, _ = fp8_batch(7, fp8, torch.float16, tree=dict(fanouts=[3, 4], max_node_blocks=3,
                                                      max_private_blocks=2), max_seqs=10)
    n, rows, width = b.query.shape[0], 12, 12
    plan = padded_to_capacity(b, rows, width)
    variant = dict(sliding_window=50, sinks=sinks_for(8, 4))
    out, lse = run(emu, b, plan, **variant, **SCALES)
    check(b, out, lse, oracle(b, **variant, **SCALES))
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


@pytest.mark.parametrize("fp8", FP8)
def test_kv_addresses_in_32_or_64_bits(emu, monkeypatch, fp8):
    # load_kv_stage's two address paths (the last launch's 5th number) over byte-sized elements.
    b, expect = fp8_batch(4, fp8, torch.bfloat16, head_size=128)
    plan = plan_of(b)
    for i64, path in (("0", 1), ("1", 0)):
        monkeypatch.setenv("CHUNKATTN_KV_OFFSETS_I64", i64)
        check(b, *run(emu, b, plan, **SCALES), expect)
        assert emu.last_launch()[4] == path


def test_scales_are_ignored_for_a_16_bit_cache(emu):
    b = random_tree_batch(8, **SHARED, num_heads=8, num_kv_heads=2, head_size=64,
                          dtype=torch.float16)
    check(b, *run(emu, b, plan_of(b), k_scale=3.0, v_scale=0.25), oracle(b))


@pytest.mark.parametrize("bad", [dict(k_scale=0.0), dict(v_scale=-1.0), dict(k_scale=float("nan")),
                                 dict(v_scale=float("inf"))])
def test_refuses_a_scale_that_is_not_positive(emu, bad):
    b, _ = fp8_batch(9, torch.float8_e4m3fn, torch.float16, tree=dict(fanouts=[1]))
    with pytest.raises(RuntimeError, match="k_scale and v_scale must be finite and > 0"):
        run(emu, b, plan_of(b), **{**SCALES, **bad})


def test_refuses_what_it_cannot_take(emu):
    b, _ = fp8_batch(9, torch.float8_e4m3fn, torch.float16, tree=dict(fanouts=[1]))
    plan = plan_of(b)
    e5m2 = b.value_cache.view(torch.uint8).view(torch.float8_e5m2)
    for value_cache in (e5m2, torch.zeros(b.value_cache.shape, dtype=torch.float16)):
        with pytest.raises(RuntimeError, match="value_cache dtype .* != key_cache dtype"):
            run(emu, replace(b, value_cache=value_cache), plan, **SCALES)
    b.query = b.query.float()                    # fp8 caches take fp16 / bf16 queries on CUDA
    with pytest.raises(RuntimeError, match="fp16/bf16"):
        run(emu, b, plan, **SCALES)
