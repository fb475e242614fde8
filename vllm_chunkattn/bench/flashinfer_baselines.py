"""FlashInfer baselines of the GPU kernel grid (flashinfer-python 0.6.x, an optional import).

  batch decode:  BatchDecodeWithPagedKVCacheWrapper, NHD pages, one page list per row (shared
                 pages repeated in every row that reads them), on tensor cores as vLLM's
                 FLASHINFER backend runs it (use_tensor_cores=True);
  ours + tails:  our op over the plan's shared nodes, FlashInfer batch decode over the private
                 tails, FlashInfer's merge_state (ours_with_fi_tails);
  cascade:       MultiLevelCascadeAttentionWrapper with the levels of cascade_levels.py. It runs one
                 BatchPrefillWithPagedKVCacheWrapper per level (backend "auto": FA3 on sm_90)
                 and merges their states with merge_state_in_place. causal=False, which is exact for
                 one query per row.
Both read the KV pool in FlashInfer's own paged layout [num_blocks, 2, block, kv_heads, head]
(KvPool layout "paged_nhd"). Our op reads the K and V halves of the same tensor in place, so
every contender reads the same bytes. (Batch decode also takes any other pool, as dense K and V
copies: bench kernel's goal grid and bench tpot use vLLM's flash layout.) Each contender is a zero-argument callable, planned
beforehand as an engine would do once per step for all layers.

python -m vllm_chunkattn.bench.flashinfer_baselines --warm float16 bfloat16 builds, for d = 128,
the JIT modules the timed calls use, by planning and running both wrappers on a tiny batch. In
FlashInfer 0.6.14 those are: the FA2 batch-prefill module (tensor-core decode with backend
"auto" runs on it: decode.py picks FA3 only for fp8), the FA3 batch-prefill module (_sm90, the
cascade's levels) and the dtype-free cascade merge module; head counts, GQA group and page size
are run-time arguments. About 10 + 10 + 2 nvcc units per dtype: minutes on a fresh device. The
bench stage runs it first, one process per dtype in parallel (FlashInfer's file lock serialises
a shared module), so the grid's timings never include a build.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from .cascade_levels import CascadeLevels

WORKSPACE_BYTES = 128 << 20      # FlashInfer's recommended float workspace
LOG2E = 1.4426950408889634


def flashinfer_version() -> tuple[str | None, str]:
    """(version, "") if flashinfer imports, else (None, why not)."""
    try:
        import flashinfer
    except Exception as e:   # ImportError, or a broken install failing on its own imports
        return None, f"flashinfer not importable: {type(e).__name__}: {e}"
    return getattr(flashinfer, "__version__", "?"), ""


def _pool(bt) -> torch.Tensor:
    if bt.kv_cache.dim() != 5 or bt.kv_cache.shape[1] != 2:
        raise ValueError("FlashInfer baselines need the KvPool layout 'paged_nhd'")
    return bt.kv_cache


def _workspace(device) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def page_lists(table: torch.Tensor, lens: torch.Tensor, block_size: int,
               first_blocks: torch.Tensor | None = None):
    """FlashInfer's paged-KV lists of the rows (host int32): indptr, page indices, last page
    lengths. first_blocks: blocks to skip at the start of each row (its shared nodes, plan
    seq_num_shared_blocks): the lists then hold each row's private tail alone."""
    table, lens = table.cpu(), lens.cpu().long()
    first = torch.zeros_like(lens) if first_blocks is None else first_blocks.cpu().long()
    if (lens - first * block_size < 1).any():
        raise ValueError("a row without a token past its first_blocks")
    end = -(-lens // block_size)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(end - first, 0)
    indices = torch.cat([table[i, a:b] for i, (a, b) in enumerate(zip(first.tolist(),
                                                                       end.tolist()))])
    return indptr, indices, ((lens - 1) % block_size + 1).to(torch.int32)


def _decode_wrapper(bt, block_size: int, first_blocks: torch.Tensor | None = None):
    """A planned BatchDecodeWithPagedKVCacheWrapper over the rows (or their tails), and the KV it
    reads: the paged pool itself, or dense K and V copies of another layout."""
    import flashinfer
    _, num_heads, head_size = bt.query.shape
    dev = bt.query.device
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(dev), "NHD",
                                                            use_tensor_cores=True)
    lists = page_lists(bt.block_table, bt.seq_lens, block_size, first_blocks)
    wrapper.plan(*(t.to(dev) for t in lists), num_heads, bt.key_cache.shape[2], head_size,
                 block_size, q_data_type=bt.query.dtype, kv_data_type=bt.query.dtype,
                 sm_scale=bt.scale)
    paged = bt.kv_cache.dim() == 5 and bt.kv_cache.shape[1] == 2
    kv = _pool(bt) if paged else (bt.key_cache.contiguous(), bt.value_cache.contiguous())
    return wrapper, kv


def batch_decode(bt, block_size: int):
    wrapper, kv = _decode_wrapper(bt, block_size)
    out = torch.empty_like(bt.query)
    return lambda: wrapper.run(bt.query, kv, out=out)


def ours_with_fi_tails(bt, plan, block_size: int):
    """Our op over the plan's shared nodes alone (every row's seq_len cut to the tokens its nodes
    cover: no private tail), FlashInfer batch decode over the private tails with their LSE, and
    FlashInfer's merge_state of the two: what handing the tails to the engine's own decode
    kernel would cost. FlashInfer's LSE is base 2 and ours natural: ours is scaled first."""
    import flashinfer

    from ..decode import TppLaunch
    from ..plan import TppWorkspace
    num_seqs, num_heads, head_size = bt.query.shape
    dev = bt.query.device
    shared_blocks = plan.seq_num_shared_blocks.cpu()
    shared_lens = (shared_blocks * block_size).to(torch.int32).to(dev)
    launch = TppLaunch(plan.to(dev), bt.block_table, shared_lens, num_heads, head_size, dev,
                       TppWorkspace(), kernel="native")
    wrapper, kv = _decode_wrapper(bt, block_size, first_blocks=shared_blocks)
    out_shared = torch.empty_like(bt.query)
    lse_shared = torch.empty(num_seqs, num_heads, dtype=torch.float32, device=dev)

    def run():
        launch.run(bt.query, bt.key_cache, bt.value_cache, bt.scale, out_shared, lse_shared)
        out_tail, lse_tail = wrapper.run(bt.query, kv, return_lse=True)
        return flashinfer.merge_state(out_shared, lse_shared * LOG2E, out_tail, lse_tail)[0]
    return run


def multi_level_cascade(bt, levels: CascadeLevels, block_size: int):
    import flashinfer
    _, num_heads, head_size = bt.query.shape
    num_kv_heads = bt.key_cache.shape[2]
    dev = bt.query.device
    wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(levels.num_levels, _workspace(dev),
                                                           "NHD")
    wrapper.plan(*levels.tensors(dev), num_heads, num_kv_heads, head_size, block_size,
                 causal=False, sm_scale=bt.scale, q_data_type=bt.query.dtype,
                 kv_data_type=bt.query.dtype)
    pool = _pool(bt)
    if levels.is_identity_order():
        return lambda: wrapper.run(bt.query, pool)
    # Rows not in DFS order: the gather into cascade order and back is part of its cost.
    order = torch.from_numpy(levels.row_order).to(dev)
    inverse = torch.from_numpy(np.argsort(levels.row_order)).to(dev)
    return lambda: wrapper.run(bt.query[order], pool)[inverse]


def jit_module_specs(dtypes=(torch.float16, torch.bfloat16), head_size: int = 128) -> list:
    """The modules warm() builds, as FlashInfer's JitSpecs, for a build with no GPU
    (benchmarks/gpu/offline/flashinfer_aot.py): the cascade merge, then per dtype the FA2 batch-prefill
    module (tensor-core decode) and the FA3 one (the cascade's levels on sm_90). The arguments are
    those the wrappers pass at plan time: int32 indptr, no positional encoding, no sliding window,
    no soft cap, no fp16 QK reduction."""
    from flashinfer.jit.attention import gen_batch_prefill_module
    from flashinfer.jit.cascade import gen_cascade_module
    specs = [gen_cascade_module()]
    for dtype in dtypes:
        for backend in ("fa2", "fa3"):
            specs.append(gen_batch_prefill_module(backend, dtype, dtype, dtype, torch.int32,
                                                  head_size, head_size, 0, False, False, False))
    return specs


def warm(dtype: torch.dtype, device: torch.device = torch.device("cuda")) -> None:
    """Plan and run both wrappers once on a tiny tree, which JIT-builds their modules."""
    from ..plan import build_plan
    from .cascade_levels import cascade_levels
    from .kv_pool import KvPool
    from .kernel_trees import SMOKE, rollouts, tree_block_table
    point = rollouts("warm", "warm", SMOKE, 2, 2, (32, 32), (0, 20), seed=0)
    pool = KvPool(1 + point.blocks_needed(), SMOKE.block_size, SMOKE.num_kv_heads,
                  SMOKE.head_size, dtype, device, "paged_nhd")
    gen = torch.Generator().manual_seed(0)
    table, lens = tree_block_table(point, pool.kv_cache.shape[0], gen)
    bt = pool.from_table(table, lens, SMOKE.num_heads, gen)
    plan = build_plan(table, lens, SMOKE.block_size)
    batch_decode(bt, SMOKE.block_size)()
    multi_level_cascade(bt, cascade_levels(plan, table, lens, SMOKE.block_size),
                        SMOKE.block_size)()
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warm", nargs="+", choices=("float16", "bfloat16"), required=True,
                   help="dtypes to JIT-build FlashInfer's d=128 modules for (FA2 + FA3 "
                        "batch prefill, cascade merge)")
    args = p.parse_args(argv)
    version, why = flashinfer_version()
    if version is None:
        print(why)
        return 1
    for name in args.warm:
        warm(getattr(torch, name))
        print(f"flashinfer {version}: {name} modules ready", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
