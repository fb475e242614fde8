"""The attention variants of tpp_decode (sliding window, logit soft-capping, attention sinks) and
the head sizes 80 / 96: the fp64 oracle against vLLM's own CPU_ATTN kernel (so the convention is
vLLM's), the readable reference and the native CPU kernel on every ISA against the oracle, over
trees whose window edges fall inside shared nodes, inside private tails and before whole nodes."""
from __future__ import annotations

import pytest
import torch

from vllm_chunkattn.bench.tree_batches import TREE_SPECS, poison_unread_kv, random_tree_batch
from vllm_chunkattn.kv_layout import kv_cache_views
from vllm_chunkattn.ops.native import native_ops
from vllm_chunkattn.ops.reference import dense_decode_oracle, tpp_decode_reference
from vllm_chunkattn.plan import build_plan

from test_ops_cpu import run_native

OPS = native_ops(torch.device("cpu"))
needs_op = pytest.mark.skipif(OPS is None, reason="vllm_chunkattn._C not built "
                              "(python setup.py build_ext --inplace)")
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# (sliding_window, soft_cap, with sinks): each alone, then together.
VARIANTS = [(1, 0.0, False), (7, 0.0, False), (20, 0.0, False), (45, 0.0, False),
            (100, 0.0, False), (0, 2.0, False), (0, 0.0, True), (23, 3.0, True)]


def _batch(seed, dtype=torch.float32, head_size=64, heads=(8, 2), block_size=16, spec="deep_tree",
           layout="cpu_attn"):
    b = random_tree_batch(seed, **TREE_SPECS[spec], num_heads=heads[0], num_kv_heads=heads[1],
                          head_size=head_size, block_size=block_size, dtype=dtype, layout=layout)
    b.query = (b.query.float() * 4).to(dtype)     # peaky scores: caps and windows matter
    return b


def _sinks(num_heads, seed):
    # of the size of the peaky scores' maxima, so each sink takes a real share of the softmax
    return 8 + 2 * torch.randn(num_heads, generator=torch.Generator().manual_seed(seed))


def _oracle(b, window, cap, sinks):
    out, lse = dense_decode_oracle(b.query, b.key_cache, b.value_cache, b.block_table,
                                   b.seq_lens, b.scale, window, cap, sinks)
    return out.float(), lse.float()


def _native(b, plan, window, cap, sinks):
    return run_native(b, plan, window=window, cap=cap, sinks=sinks)


def test_window_edges_cover_every_case():
    """The batches below put window edges inside shared nodes, inside private tails, and past
    whole nodes for some sharers (so those partials are empty), or the cases are not tested."""
    b = _batch(3)
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    lens = b.seq_lens.long()
    starts = plan.node_first_block.long() * b.block_size
    ends = starts + (plan.node_block_indptr[1:] - plan.node_block_indptr[:-1]).long() * b.block_size
    rows = plan.node_seq_ids.long()
    node_of = torch.repeat_interleave(torch.arange(plan.num_nodes),
                                      (plan.node_seq_indptr[1:] - plan.node_seq_indptr[:-1]).long())
    seen = set()
    for window, _, _ in VARIANTS:
        edge = (lens[rows] - window).clamp_min(0)
        seen |= {"past node"} if bool((edge >= ends[node_of]).any()) else set()
        seen |= {"in node"} if bool(((edge > starts[node_of]) & (edge < ends[node_of])).any()) else set()
        tail = plan.seq_num_shared_blocks.long() * b.block_size
        seen |= {"in tail"} if bool(((lens - window) > tail).any()) else set()
    assert seen == {"past node", "in node", "in tail"}


@pytest.mark.parametrize("window,cap,use_sinks", VARIANTS)
@pytest.mark.parametrize("spec", ("deep_tree", "system_prompts"))
def test_reference_matches_oracle(window, cap, use_sinks, spec):
    b = _batch(5, spec=spec)
    sinks = _sinks(b.query.shape[1], 1) if use_sinks else None
    out, lse = tpp_decode_reference(b.query, b.key_cache, b.value_cache, b.block_table,
                                    b.seq_lens, build_plan(b.block_table, b.seq_lens, b.block_size),
                                    b.scale, return_lse=True, sliding_window=window,
                                    soft_cap=cap, sinks=sinks)
    ref, ref_lse = _oracle(b, window, cap, sinks)
    torch.testing.assert_close(out.float(), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


def test_variants_change_the_result():
    """The inputs are peaky enough that each variant changes the output: a kernel that ignored
    one would fail the comparisons above."""
    b = _batch(5)
    plain, _ = _oracle(b, 0, 0.0, None)
    for window, cap, use_sinks in VARIANTS:
        out, _ = _oracle(b, window, cap, _sinks(b.query.shape[1], 1) if use_sinks else None)
        assert (out - plain).abs().max() > 1e-2, (window, cap, use_sinks)


ISAS = ("amx", "avx512_bf16", "avx512", "avx2", "scalar")
ISA_DTYPES = [(isa, dtype) for isa in ISAS for dtype in (torch.float32, torch.bfloat16)
              if isa not in ("amx", "avx512_bf16") or dtype == torch.bfloat16]


def _use_isa(isa, monkeypatch):
    monkeypatch.setenv("CHUNKATTN_CPU_ISA", isa)


def _native_isa_available(isa, monkeypatch) -> bool:
    """Whether this CPU runs `isa`'s kernel (probed at head size 64); leaves it forced."""
    _use_isa(isa, monkeypatch)
    b = _batch(0, dtype=torch.bfloat16, spec="system_prompts")
    try:
        _native(b, build_plan(b.block_table, b.seq_lens, b.block_size), 0, 0.0, None)
        return True
    except RuntimeError as e:
        if "no CPU kernel" in str(e):
            return False
        raise


@needs_op
@pytest.mark.parametrize("isa,dtype", ISA_DTYPES, ids=[f"{i}-{str(d)[6:]}" for i, d in ISA_DTYPES])
@pytest.mark.parametrize("window,cap,use_sinks", VARIANTS)
def test_native_matches_oracle(isa, dtype, window, cap, use_sinks, monkeypatch):
    _use_isa(isa, monkeypatch)
    # Many sharers per node for the bf16 kernels (AMX takes >= 8 rows), GQA 3:1.
    spec = "system_prompts" if isa in ("amx", "avx512_bf16") else "deep_tree"
    b = _batch(7, dtype=dtype, heads=(9, 3), spec=spec, block_size=32 if isa == "amx" else 16)
    sinks = _sinks(9, 2) if use_sinks else None
    try:
        out, lse = _native(b, build_plan(b.block_table, b.seq_lens, b.block_size), window, cap, sinks)
    except RuntimeError as e:
        if "no CPU kernel" in str(e):
            pytest.skip(f"this CPU lacks {isa}")
        raise
    ref, ref_lse = _oracle(b, window, cap, sinks)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, atol=TOL[dtype], rtol=TOL[dtype])


@needs_op
@pytest.mark.parametrize("isa,dtype", ISA_DTYPES, ids=[f"{i}-{str(d)[6:]}" for i, d in ISA_DTYPES])
@pytest.mark.parametrize("layout", ("cpu_attn", "flash"))
def test_keys_no_reader_sees_are_never_read(isa, dtype, layout, monkeypatch):
    """KV before every reader's window edge (and past each sequence) filled with NaN: nothing of
    it reaches a result (a masked score still multiplies its V row: 0 x NaN = NaN)."""
    _use_isa(isa, monkeypatch)
    spec = "system_prompts" if isa in ("amx", "avx512_bf16") else "deep_tree"
    b = _batch(9, dtype=dtype, heads=(9, 3), spec=spec, block_size=32, layout=layout)
    for window in (7, 45):
        ref, ref_lse = _oracle(b, window, 0.0, None)
        poisoned = _batch(9, dtype=dtype, heads=(9, 3), spec=spec, block_size=32, layout=layout)
        assert poison_unread_kv(poisoned, window) > 0
        try:
            out, lse = _native(poisoned, build_plan(b.block_table, b.seq_lens, b.block_size),
                               window, 0.0, None)
        except RuntimeError as e:
            if "no CPU kernel" in str(e):
                pytest.skip(f"this CPU lacks {isa}")
            raise
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(lse, ref_lse, atol=TOL[dtype], rtol=TOL[dtype])


@needs_op
@pytest.mark.parametrize("isa,dtype", ISA_DTYPES, ids=[f"{i}-{str(d)[6:]}" for i, d in ISA_DTYPES])
@pytest.mark.parametrize("head_size", (80, 96))
def test_head_sizes_80_96(isa, dtype, head_size, monkeypatch):
    """Phi-3 (96) and 80: every ISA, with a window and a cap. AMX tiles take multiples of 64
    only: forced, it refuses these; unforced, the AVX512_BF16 kernel takes them."""
    b = _batch(head_size, dtype=dtype, head_size=head_size, heads=(6, 2), spec="system_prompts",
               layout="flash" if head_size == 80 else "cpu_attn")
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    if isa == "amx":
        if _native_isa_available("amx", monkeypatch):
            with pytest.raises(RuntimeError, match=f"no CPU kernel for head_size {head_size}"):
                _native(b, plan, 0, 0.0, None)
        monkeypatch.delenv("CHUNKATTN_CPU_ISA")
    else:
        _use_isa(isa, monkeypatch)
    try:
        for window, cap in ((0, 0.0), (30, 2.0)):
            out, lse = _native(b, plan, window, cap, None)
            ref, ref_lse = _oracle(b, window, cap, None)
            torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
            torch.testing.assert_close(lse, ref_lse, atol=TOL[dtype], rtol=TOL[dtype])
    except RuntimeError as e:
        if "no CPU kernel" in str(e) and "CHUNKATTN_CPU_ISA" in str(e) and isa != "amx":
            pytest.skip(f"this CPU lacks {isa}")
        raise


@needs_op
def test_sinks_on_a_row_without_keys_and_bad_arguments():
    b = _batch(1)
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    num_heads = b.query.shape[1]
    with pytest.raises(RuntimeError, match="sliding_window must be >= 0"):
        _native(b, plan, -1, 0.0, None)
    with pytest.raises(RuntimeError, match="soft_cap must be >= 0"):
        _native(b, plan, 0, float("nan"), None)
    for bad in (torch.zeros(num_heads + 1), torch.zeros(num_heads, dtype=torch.bfloat16)):
        with pytest.raises(RuntimeError, match="sinks must be contiguous float32"):
            _native(b, plan, 0, 0.0, bad)
    # A zero-length row: its state is empty, so with a sink its output is 0 and lse the sink.
    b.seq_lens = b.seq_lens.clone()
    b.seq_lens[0] = 0
    plan = build_plan(b.block_table, b.seq_lens, b.block_size)
    sinks = _sinks(num_heads, 3)
    out, lse = _native(b, plan, 0, 0.0, sinks)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(lse[0], sinks)


@pytest.mark.vllm
@pytest.mark.parametrize("window,cap,use_sinks", [(23, 0.0, False), (5, 0.0, False),
                                                  (0, 3.0, False), (0, 0.0, True),
                                                  (40, 3.0, True)])
def test_oracle_is_vllm_cpu_attn(window, cap, use_sinks):
    """vLLM's CPU_ATTN decode (called as vllm/v1/attention/backends/cpu_attn.py calls it) with
    the same window, cap and sinks gives the oracle's result: the variants mean what they mean
    in vLLM."""
    pytest.importorskip("vllm")
    from vllm import _custom_ops as vllm_ops
    b = _batch(11, heads=(8, 2), block_size=32)
    num_blocks, num_kv_heads, block_size, two_d = b.kv_cache.shape
    vk, vv = b.kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)
    b.key_cache, b.value_cache = kv_cache_views(b.kv_cache, "cpu_attn")
    num_seqs, num_heads, head_size = b.query.shape
    sinks = _sinks(num_heads, 4) if use_sinks else None
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    sched = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size,
        seq_lens=b.seq_lens, dtype=torch.float32, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=window or -1, isa="vec", enable_kv_split=True)
    theirs = torch.empty_like(b.query)
    vllm_ops.cpu_attention_with_kv_cache(
        query=b.query, key_cache=vk, value_cache=vv, output=theirs, query_start_loc=query_start_loc,
        seq_lens=b.seq_lens, scale=b.scale, causal=True, alibi_slopes=None,
        sliding_window=window or -1, block_table=b.block_table, softcap=cap,
        scheduler_metadata=sched, s_aux=sinks)
    ref, _ = _oracle(b, window, cap, sinks)
    torch.testing.assert_close(theirs, ref, atol=1e-4, rtol=1e-4)
