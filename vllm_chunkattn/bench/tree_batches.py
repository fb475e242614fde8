"""Seeded random tree-shaped decode batches over a paged KV cache, for tests and benchmarks, and
the checks a TPP kernel's output on them must pass.

A batch is a random prefix tree of blocks (depth, fan-out) whose leaves get private tails, laid out
in a KV cache whose physical block ids are randomly permuted (block 0 stays the null block, as in
vLLM). The cache uses one of vLLM's layouts, so kernels are tested on the strides they will read.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..kv_layout import alloc_kv_cache, kv_cache_views, write_logical
from ..plan import PlanCapacity, TppPlan, build_plan, pad_plan


@dataclass
class TreeBatch:
    query: torch.Tensor        # [num_seqs, num_heads, head_size]
    kv_cache: torch.Tensor     # vLLM's logical [num_blocks, num_kv_heads, block_size, 2*head_size]
    key_cache: torch.Tensor    # [num_blocks, block_size, num_kv_heads, head_size] (strided view)
    value_cache: torch.Tensor
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32, 0-padded
    seq_lens: torch.Tensor     # [num_seqs] int32
    block_size: int
    scale: float


def random_tree_batch(seed: int, *, depth: int = 2, fanout: int = 3, max_node_blocks: int = 2,
                      max_private_blocks: int = 2, num_heads: int = 8, num_kv_heads: int = 2,
                      head_size: int = 64, block_size: int = 16, dtype=torch.float32,
                      device="cpu", layout: str = "flash", max_seqs: int | None = None,
                      fanouts: list[int] | None = None, shuffle: bool = True) -> TreeBatch:
    """A tree of `depth` levels (or len(fanouts) levels with fixed fan-outs), each node fanning
    out to 1..fanout children and holding 1..max_node_blocks full blocks; every leaf is a sequence
    with 0..max_private_blocks private full blocks plus a partial tail of 1..block_size tokens.
    Depth 1 means no sharing: every sequence has its own first-level node."""
    g = torch.Generator().manual_seed(seed)

    def rint(lo, hi):                     # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    paths: list[list[str]] = [[]]         # node labels; same label = same physical blocks
    node_blocks: dict[str, int] = {}
    for level in range(len(fanouts) if fanouts else depth):
        grown = []
        for p in paths:
            for c in range(fanouts[level] if fanouts else rint(1, fanout)):
                label = f"{'.'.join(p)}/{level}:{c}"
                node_blocks[label] = rint(1, max_node_blocks)
                grown.append(p + [label])
        paths = grown
    if max_seqs is not None:
        paths = paths[:max_seqs]
    tails = [rint(0, max_private_blocks) for _ in paths]
    partial = [rint(1, block_size) for _ in paths]
    num_logical = sum(node_blocks.values()) + sum(t + 1 for t in tails)
    num_blocks = num_logical + 1 + rint(0, 8)            # block 0 = null, plus unused blocks
    physical = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    node_ids = {}
    for label, n in node_blocks.items():
        node_ids[label] = [physical.pop() for _ in range(n)]
    rows, lens = [], []
    for p, t, last in zip(paths, tails, partial):
        ids = [b for label in p for b in node_ids[label]] + [physical.pop() for _ in range(t + 1)]
        rows.append(ids)
        lens.append((len(ids) - 1) * block_size + last)
    if shuffle:
        perm = torch.randperm(len(rows), generator=g).tolist()
        rows, lens = [rows[i] for i in perm], [lens[i] for i in perm]
    width = max(len(r) for r in rows)
    block_table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, r in enumerate(rows):
        block_table[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
    kv_cache = alloc_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device,
                              layout)
    key_cache, value_cache = kv_cache_views(kv_cache, layout)
    logical = (num_blocks, block_size, num_kv_heads, head_size)   # the same K/V in every layout
    write_logical(key_cache, torch.randn(logical, generator=g).to(dtype))
    write_logical(value_cache, torch.randn(logical, generator=g).to(dtype))
    query = torch.randn(len(rows), num_heads, head_size, generator=g).to(dtype).to(device)
    return TreeBatch(query, kv_cache, key_cache, value_cache, block_table.to(device),
                     torch.tensor(lens, dtype=torch.int32, device=device), block_size,
                     head_size ** -0.5)


def fp8_kv_batch(b: TreeBatch, fp8_dtype: torch.dtype, k_scale: float = 1.0,
                 v_scale: float = 1.0, layout: str = "flash") -> TreeBatch:
    """`b` with its KV stored as vLLM stores an fp8 cache: a uint8 tensor in `layout` holding
    K / k_scale and V / v_scale, read through `fp8_dtype` (float8_e4m3fn / float8_e5m2) views
    that a kernel takes with the scales."""
    num_blocks, block_size, num_kv_heads, head_size = b.key_cache.shape
    kv_cache = alloc_kv_cache(num_blocks, block_size, num_kv_heads, head_size, torch.uint8,
                              b.key_cache.device, layout)
    key_cache, value_cache = (v.view(fp8_dtype) for v in kv_cache_views(kv_cache, layout))
    key_cache.copy_((b.key_cache.float() / k_scale).to(fp8_dtype))
    value_cache.copy_((b.value_cache.float() / v_scale).to(fp8_dtype))
    return replace(b, kv_cache=kv_cache, key_cache=key_cache, value_cache=value_cache)


def caterpillar_batch(num_rows: int, block_size: int = 16, **kwargs) -> TreeBatch:
    """The deepest tree of num_rows rows: row i holds blocks 1..i+1 in full (the last row as many
    as the one before), then a private partial block. num_rows - 1 nested nodes and
    num_rows * (num_rows + 1) / 2 - 1 partials (capacity mode must prune it, plan/capacity.py).
    kwargs: random_tree_batch's heads, head_size, dtype, device."""
    b = random_tree_batch(num_rows, fanouts=[num_rows], max_node_blocks=1, max_private_blocks=0,
                          block_size=block_size, **kwargs)
    g = torch.Generator().manual_seed(num_rows)
    rows, lens = [], []
    for i in range(num_rows):
        ids = list(range(1, min(i + 1, num_rows - 1) + 1)) + [num_rows + i]
        rows.append(ids + [0] * (num_rows - len(ids)))
        lens.append((len(ids) - 1) * block_size + int(torch.randint(1, block_size + 1, (1,),
                                                                    generator=g)))
    dev, dtype = b.kv_cache.device, b.kv_cache.dtype
    b.kv_cache = alloc_kv_cache(2 * num_rows, block_size, b.key_cache.shape[2],
                                b.key_cache.shape[3], dtype, dev, "flash")
    b.kv_cache.copy_(torch.randn(b.kv_cache.shape, generator=g).to(dtype))
    b.key_cache, b.value_cache = kv_cache_views(b.kv_cache, "flash")
    b.block_table = torch.tensor(rows, dtype=torch.int32, device=dev)
    b.seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    return b


def pad_batch(b: TreeBatch, num_rows: int, width: int) -> TreeBatch:
    """vLLM's CUDA-graph padding, in place: rows up to a captured batch size with seq_len 0 and
    null block ids (and random queries), block table columns up to width."""
    extra = num_rows - b.query.shape[0]
    g = torch.Generator().manual_seed(num_rows)
    pad_q = torch.randn(extra, *b.query.shape[1:], generator=g).to(b.query.dtype)
    b.query = torch.cat([b.query, pad_q.to(b.query.device)])
    b.block_table = torch.nn.functional.pad(b.block_table,
                                            (0, width - b.block_table.shape[1], 0, extra))
    b.seq_lens = torch.nn.functional.pad(b.seq_lens, (0, extra))
    return b


# Named shapes (vLLM BATCH_SPECS style): each is keyword arguments for random_tree_batch.
TREE_SPECS: dict[str, dict] = {
    "no_sharing": dict(fanouts=[8], max_node_blocks=2, max_private_blocks=3),
    "single_prefix": dict(fanouts=[1, 8], max_node_blocks=4, max_private_blocks=0),
    "system_prompts": dict(fanouts=[3, 6], max_node_blocks=3, max_private_blocks=2),
    "deep_tree": dict(depth=4, fanout=3, max_node_blocks=2, max_private_blocks=3),
    "node_ends_at_last_token": dict(fanouts=[1, 4], max_node_blocks=2, max_private_blocks=0),
    "batch_17": dict(fanouts=[2, 9], max_node_blocks=2, max_private_blocks=2, max_seqs=17),
    "batch_1": dict(fanouts=[1], max_node_blocks=2, max_private_blocks=1),
}
# Nodes and tails of up to 24 and 20 blocks of 16: 2-6 shared-memory stages per CUDA CTA, so the
# kernel's cp.async double buffer turns over (every TREE_SPECS tree fits in one or two stages).
LONG_TREE = dict(fanouts=[2, 3], max_node_blocks=24, max_private_blocks=20)
# A long node shared by 16 rows: with 4 q heads a kv head, chunk CTAs of 64 rows (4 row blocks)
# that turn the cp.async double buffer over.
WIDE_LONG_TREE = dict(fanouts=[1, 16], max_node_blocks=24, max_private_blocks=2)


def named_tree(name: str) -> dict:
    """random_tree_batch's keywords for a TREE_SPECS name, "long" or "wide_long"."""
    return {"long": LONG_TREE, "wide_long": WIDE_LONG_TREE}.get(name) or TREE_SPECS[name]


# The CUDA launches' compact smem stages (CHUNKATTN_{FINAL,PARTIAL}_STAGE_TOKENS), as (launch,
# (spec, head size, forced chunk / tail splits)): the final launch's tails (nothing shared among
# them too), the partial launch's chunk CTAs of 4 to 64 rows (GQA 4: 1, 2 and 4 row blocks; 64
# rows over many stages in wide_long) and tail splits. The SIMT emulation and the GPU tests run
# the same.
COMPACT_STAGE_CASES = [("final", c) for c in [("long", 64, (1, 1)), ("long", 128, (1, 3)),
                                              ("deep_tree", 128, (4, 4)), ("no_sharing", 128, (1, 2)),
                                              ("system_prompts", 64, (3, 2))]] + \
                      [("partial", c) for c in [("long", 64, (3, 3)), ("long", 128, (2, 3)),
                                                ("deep_tree", 128, (4, 4)), ("system_prompts", 128, (1, 1)),
                                                ("batch_17", 64, (2, 2)), ("wide_long", 128, (1, 1))]]


# Tolerances of the tensor-core kernels (fp16/bf16 inputs, fp32 accumulation) against the fp32
# reference: the CUDA op's tests on a GPU and its SIMT emulation on CPU use the same.
TC_TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
TC_LSE_TOL = {torch.float16: dict(atol=1e-3, rtol=1e-3), torch.bfloat16: dict(atol=5e-3, rtol=5e-3)}


def poison_unread_kv(b: TreeBatch, sliding_window: int = 0) -> int:
    """Fills with NaN every KV cache row no sequence of `b` reads (the null block 0, unused
    blocks, each last block past its sequence's length, and with a sliding window the rows
    before every reader's window); the reference is unchanged, and a kernel that lets any of them
    in (a stage's tokens past its run not zero-filled, or KV no row of a CTA sees loaded: a
    masked score still multiplies its V row, 0 x NaN = NaN) fails it. Returns the rows filled.
    Any layout: the 6-D "cpu_attn_amx" views split a block's rows in their first three dims."""
    read = torch.zeros(b.key_cache.shape[0], b.block_size, dtype=torch.bool)  # [block, row]
    for row, n in zip(b.block_table.tolist(), b.seq_lens.tolist()):
        t = torch.arange(max(0, n - sliding_window) if sliding_window > 0 else 0, n)
        read[torch.tensor(row)[t // b.block_size], t % b.block_size] = True
    unread = (~read).to(b.key_cache.device)
    for cache in (b.key_cache, b.value_cache):
        cache[unread.view(cache.shape[:3]) if cache.dim() == 6 else unread] = float("nan")
    return int(unread.sum())


def value_cache_elsewhere(b: TreeBatch) -> dict[str, TreeBatch]:
    """The batch with its V cache copied out of the KV tensor, two ways a kernel's address paths
    tell apart: "same_strides", V in a second cache of the same layout (K's strides, another
    allocation), and "own_strides", V with a padded last dim (strides of its own)."""
    num_blocks, block_size, num_kv_heads, head_size = b.key_cache.shape
    other = alloc_kv_cache(num_blocks, block_size, num_kv_heads, head_size, b.value_cache.dtype,
                           b.value_cache.device, "flash")
    same = kv_cache_views(other, "flash")[1]
    padded = torch.zeros(*b.value_cache.shape[:3], head_size + 8, dtype=b.value_cache.dtype,
                         device=b.value_cache.device)
    own = padded[..., :head_size]
    for value_cache in (same, own):
        value_cache.copy_(b.value_cache)
    assert same.stride() == b.key_cache.stride() and same.data_ptr() != b.value_cache.data_ptr()
    assert own.stride() != b.key_cache.stride()
    return {"same_strides": replace(b, value_cache=same), "own_strides": replace(b, value_cache=own)}


def assert_matches_reference(b: TreeBatch, plan, out: torch.Tensor, lse: torch.Tensor) -> None:
    """out / lse of a tensor-core TPP kernel (every element written: no NaN) against
    tpp_decode_reference of the same batch and plan."""
    from ..ops.reference import tpp_decode_reference
    ref, ref_lse = tpp_decode_reference(b.query, b.key_cache, b.value_cache, b.block_table,
                                        b.seq_lens, plan, b.scale, return_lse=True)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, ref, **TC_TOL[b.query.dtype])
    torch.testing.assert_close(lse, ref_lse, **TC_LSE_TOL[b.query.dtype])


def padded_to_capacity(b: TreeBatch, rows: int, width: int) -> TppPlan:
    """Pads `b` to `rows` rows of `width` blocks (pad_batch) and returns its plan padded to that
    batch's capacities (plan/capacity.py), on b's device: the plan a captured graph replays."""
    cap = PlanCapacity.for_batch(rows, width)
    pad_batch(b, rows, width)
    plan = build_plan(b.block_table.cpu(), b.seq_lens.cpu(), b.block_size,
                      max_partials=cap.num_partials, max_node_blocks=cap.num_node_blocks)
    return pad_plan(plan, cap).to(b.query.device)
