"""How the CUDA op cuts each point of the GPU benchmark grid into CTAs, from its own host code
(csrc/cuda/tpp_host.h, make_tpp_work, through the SIMT emulation's library; no GPU): the KV
splits it picks, the partial launch's CTAs that hold rows and its waves of resident CTAs, and
the final launch's CTAs. The workspace is the one bench kernel gives our op (TppWorkspace on
CUDA). A model of the launch, not a timing: bench kernel's split sweep measures it on a GPU.

    .venv/bin/python benchmarks/gpu/launch_waves.py                 # an H100 at head 128: 132 x 2
    .venv/bin/python benchmarks/gpu/launch_waves.py --resident 396  # e.g. 3 CTAs per SM
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from vllm_chunkattn.bench.kernel_trees import ALL_GPU, GRIDS, tree_block_table
from vllm_chunkattn.plan import TppWorkspace
from vllm_chunkattn.ops.jit_build import load_simt_emulation
from vllm_chunkattn.plan import build_plan
from vllm_chunkattn.bench.cuda_work import chunk_ctas_with_rows, tpp_work

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--resident", type=int, default=132 * 2,
                   help="partial-kernel CTAs the device runs at once (SMs x CTAs per SM)")
    p.add_argument("--csrc", type=Path, default=ROOT / "csrc",
                   help="the sources to build the emulation from (tests: the copy they test)")
    args = p.parse_args()
    load_simt_emulation(args.csrc)
    print(f"resident CTAs: {args.resident}\n")
    print("| grid | point | chunk splits | tail splits | partial CTAs | waves | final CTAs |")
    print("|---|---|---|---|---|---|---|")
    for grid in ALL_GPU:
        for point in GRIDS[grid]():
            shape = point.shape
            table, lens = tree_block_table(point, point.blocks_needed() + 1,
                                           torch.Generator().manual_seed(0))
            plan = build_plan(table, lens, shape.block_size)
            rows = table.shape[0]
            w = tpp_work(torch.ops.chunkattn_simt, rows, shape.num_heads, shape.num_kv_heads,
                         shape.block_size, plan.num_nodes, plan.num_partials,
                         plan.node_block_ids.numel(), table.shape[1],
                         TppWorkspace().rows(plan.num_partials, rows, "cuda"), args.resident)
            tail_ctas = rows * w["seq_head_tiles"] * shape.num_kv_heads
            partial = (w["chunk_splits"] * chunk_ctas_with_rows(
                plan, w["chunk_seqs"], w["chunk_head_tiles"], shape.num_kv_heads)
                + (w["seq_splits"] - 1) * tail_ctas)
            waves = f"{partial / args.resident:.2f}" if partial else "-"
            print(f"| {grid} | {point.label} | {w['chunk_splits']} | {w['seq_splits']} | "
                  f"{partial} | {waves} | {tail_ctas} |")


if __name__ == "__main__":
    main()
