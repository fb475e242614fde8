"""The CPU kernel on CPU_ATTN's AMX cache layout (kv_layout "cpu_attn_amx"): the 6-D views read
back exactly what vLLM's own AMX reshape_and_cache writes; the bf16 kernels (amx, avx512_bf16)
read it in place and give the same result as on the portable layout holding the same K/V, and the
oracle's, over trees, GQA, head and block sizes, windows, soft-caps and sinks, with NaN in slots
no row reads; CPU_ATTN's own AMX decode agrees; every other kernel and device refuses it."""
from __future__ import annotations

import pytest
import torch

from vllm_chunkattn.bench.tree_batches import TREE_SPECS, poison_unread_kv, random_tree_batch
from vllm_chunkattn.kv_layout import kv_cache_views, logical_cache
from vllm_chunkattn.ops.native import native_ops
from vllm_chunkattn.ops.reference import dense_decode_oracle
from vllm_chunkattn.plan import build_plan

from test_ops_cpu import run_native

OPS = native_ops(torch.device("cpu"))
HAS_BF16_KERNELS = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
pytestmark = [
    pytest.mark.skipif(OPS is None, reason="vllm_chunkattn._C not built"),
    pytest.mark.skipif(not HAS_BF16_KERNELS, reason="the AMX layout is read by the bf16 kernels, "
                       "which need AVX512_BF16"),
]
BF16 = torch.bfloat16


def _native(b, window=0, cap=0.0, sinks=None):
    return run_native(b, build_plan(b.block_table, b.seq_lens, b.block_size), window=window,
                      cap=cap, sinks=sinks)


def _pair(seed, **kw):
    """The same random tree and K/V in the portable and the AMX layout."""
    return (random_tree_batch(seed, dtype=BF16, layout="cpu_attn", **kw),
            random_tree_batch(seed, dtype=BF16, layout="cpu_attn_amx", **kw))


def _isa(isa, monkeypatch):
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU lacks AMX")
    if isa:
        monkeypatch.setenv("CHUNKATTN_CPU_ISA", isa)


def _assert_as_on_portable(isa, head_size, got, portable):
    """(out, lse) on the AMX layout against the same call on the portable layout."""
    if isa != "avx512_bf16" and head_size != 96 and torch.cpu._is_amx_tile_supported():
        # The AMX kernel takes tiles from one row on the AMX layout (nothing to pack) and from
        # 8 rows on the portable one: the same products summed in another order, and P, rounded
        # to bf16 for P.V, may round a step the other way (2^-8).
        for a, b in zip(got, portable):
            torch.testing.assert_close(a, b, atol=2 ** -8, rtol=2 ** -8)
    else:   # the same products on the same values in the same order: bit for bit
        assert all(torch.equal(a, b) for a, b in zip(got, portable))


def test_views_name_the_same_kv():
    vec, amx = _pair(3, **TREE_SPECS["system_prompts"], head_size=128, block_size=32)
    for a, b in ((vec.key_cache, amx.key_cache), (vec.value_cache, amx.value_cache)):
        assert b.dim() == 6 and torch.equal(logical_cache(b), a)
    # and they really are another arrangement of the same bytes
    assert not torch.equal(vec.kv_cache, amx.kv_cache)
    assert torch.equal(vec.kv_cache.flatten().sort().values, amx.kv_cache.flatten().sort().values)


CASES = [  # spec, heads, head_size, block_size
    ("system_prompts", (8, 2), 128, 32),
    ("deep_tree", (9, 3), 64, 64),
    ("batch_17", (8, 1), 256, 32),
    ("no_sharing", (32, 8), 64, 128),
    ("batch_17", (8, 2), 96, 64),
]


@pytest.mark.parametrize("isa", ("", "amx", "avx512_bf16"))
@pytest.mark.parametrize("spec,heads,head_size,block_size", CASES)
def test_same_result_as_portable_layout(isa, spec, heads, head_size, block_size, monkeypatch):
    _isa(isa, monkeypatch)
    if isa == "amx" and head_size == 96:
        pytest.skip("the AMX kernel holds head sizes 64, 128, 256 (96 runs on avx512_bf16)")
    vec, amx = _pair(head_size + block_size, **TREE_SPECS[spec], num_heads=heads[0],
                     num_kv_heads=heads[1], head_size=head_size, block_size=block_size)
    out, lse = _native(amx)
    ref_out, ref_lse = _native(vec)
    _assert_as_on_portable(isa, head_size, (out, lse), (ref_out, ref_lse))
    oracle, oracle_lse = dense_decode_oracle(vec.query, vec.key_cache, vec.value_cache,
                                             vec.block_table, vec.seq_lens, vec.scale)
    torch.testing.assert_close(out, oracle.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, oracle_lse.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("isa", ("", "amx", "avx512_bf16"))
def test_many_rows_long_nodes(isa, monkeypatch):
    """~60 rows a node (the AMX kernel's tiles), nodes of ~1000 tokens (several chunks)."""
    _isa(isa, monkeypatch)
    vec, amx = _pair(5, fanouts=[1, 2, 10], max_node_blocks=16, max_private_blocks=1,
                     num_heads=12, num_kv_heads=2, head_size=128, block_size=32)
    _assert_as_on_portable(isa, 128, _native(amx), _native(vec))


@pytest.mark.parametrize("isa", ("", "amx", "avx512_bf16"))
@pytest.mark.parametrize("window,cap,with_sinks", [(40, 0.0, False), (0, 5.0, True), (70, 5.0, True)])
def test_variants_and_unread_slots(isa, window, cap, with_sinks, monkeypatch):
    """A window's hidden keys and slots past seq_len hold NaN (vLLM never clears freed slots):
    partial tiles are packed with them masked out, full ones read in place."""
    _isa(isa, monkeypatch)
    vec, amx = _pair(11, **TREE_SPECS["system_prompts"], num_heads=8, num_kv_heads=2,
                     head_size=128, block_size=32)
    poisoned = poison_unread_kv(amx, window)
    assert poisoned
    sinks = torch.randn(8) if with_sinks else None
    out, lse = _native(amx, window, cap, sinks)
    ref_out, ref_lse = _native(vec, window, cap, sinks)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    _assert_as_on_portable(isa, 128, (out, lse), (ref_out, ref_lse))


@pytest.mark.parametrize("isa", ("avx512", "avx2", "scalar"))
def test_other_kernels_refuse_it(isa, monkeypatch):
    monkeypatch.setenv("CHUNKATTN_CPU_ISA", isa)
    _, amx = _pair(0, **TREE_SPECS["batch_1"], head_size=128, block_size=32)
    with pytest.raises(RuntimeError, match="AMX cache layout is read by the amx and avx512_bf16"):
        _native(amx)


def test_bad_views_refused():
    _, amx = _pair(0, **TREE_SPECS["batch_1"], head_size=128, block_size=32)
    amx.query = amx.query.float()
    with pytest.raises(RuntimeError, match="AMX cache layout"):
        _native(amx)
    _, amx = _pair(0, **TREE_SPECS["batch_1"], head_size=128, block_size=32)
    amx.key_cache = amx.key_cache.contiguous()   # the right shape, not CPU_ATTN's arrangement
    with pytest.raises(RuntimeError, match="strides .* are not CPU_ATTN's"):
        _native(amx)
    _, amx = _pair(0, **TREE_SPECS["batch_1"], head_size=128, block_size=32)
    amx.key_cache = amx.key_cache.transpose(4, 1)
    with pytest.raises(RuntimeError, match="do not match head_size"):
        _native(amx)
    _, amx = _pair(0, **TREE_SPECS["batch_1"], head_size=128, block_size=32)
    amx.value_cache = amx.value_cache.transpose(1, 2)
    with pytest.raises(RuntimeError, match="6-D caches must be views of CPU_ATTN's AMX layout"):
        _native(amx)
    _, amx = _pair(0, **TREE_SPECS["batch_1"], head_size=128, block_size=32)
    amx.key_cache, amx.value_cache = kv_cache_views(amx.kv_cache.float(), "cpu_attn_amx")
    with pytest.raises(RuntimeError, match="AMX layout holds bf16"):
        _native(amx)


@pytest.mark.vllm
@pytest.mark.parametrize("block_size,head_size", [(32, 128), (64, 64), (128, 256)])
def test_reads_what_vllm_amx_writes(block_size, head_size):
    """vLLM's CPU_ATTN writes the cache with isa "amx"; our views read back its K/V, our kernel
    agrees with the oracle on them and with CPU_ATTN's own AMX decode."""
    pytest.importorskip("vllm")
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM's AMX attention needs AMX")
    from vllm import _custom_ops as vllm_ops
    b = random_tree_batch(block_size, **TREE_SPECS["system_prompts"], num_heads=8, num_kv_heads=2,
                          head_size=head_size, block_size=block_size, dtype=BF16,
                          layout="cpu_attn_amx")
    num_blocks, num_kv_heads, _, two_d = b.kv_cache.shape
    key = torch.randn(num_blocks * block_size, num_kv_heads, two_d // 2).to(BF16)
    value = torch.randn_like(key)
    kv_cache = torch.zeros_like(b.kv_cache)
    vk, vv = kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)
    vllm_ops.cpu_attn_reshape_and_cache(key, value, vk, vv, torch.arange(key.shape[0]), "amx")
    b.kv_cache = kv_cache
    b.key_cache, b.value_cache = kv_cache_views(kv_cache, "cpu_attn_amx")
    assert torch.equal(logical_cache(b.key_cache).flatten(0, 1), key)
    assert torch.equal(logical_cache(b.value_cache).flatten(0, 1), value)
    out, lse = _native(b)
    ref, ref_lse = dense_decode_oracle(b.query, b.key_cache, b.value_cache, b.block_table,
                                       b.seq_lens, b.scale)
    torch.testing.assert_close(out, ref.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-2, rtol=1e-2)
    num_seqs, num_heads, _ = b.query.shape
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    sched = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size,
        seq_lens=b.seq_lens, dtype=BF16, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=-1, isa="amx", enable_kv_split=True)
    theirs = torch.empty_like(b.query)
    vllm_ops.cpu_attention_with_kv_cache(
        query=b.query, key_cache=vk, value_cache=vv, output=theirs, query_start_loc=query_start_loc,
        seq_lens=b.seq_lens, scale=b.scale, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=b.block_table, softcap=0, scheduler_metadata=sched, s_aux=None)
    torch.testing.assert_close(out.to(BF16).float(), theirs.float(), atol=2e-2, rtol=2e-2)
