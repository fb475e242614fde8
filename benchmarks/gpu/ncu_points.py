"""Hardware counters of our CUDA kernels at the points furthest from their goals and at the
shape the H100's served A/B decodes, for Nsight Compute: run_on_device.sh
runs each point in its own `ncu -k regex:tpp_` process and `--summary` turns the CSVs into one
table.

  python benchmarks/gpu/ncu_points.py POINT          # one call of our op at POINT (under ncu)
  python benchmarks/gpu/ncu_points.py --summary CSV...   # DRAM %, occupancy, ... per kernel, and
                                                       # stall reasons from ncu_stalls_*.csv

Points (one layer, one decode step), the bench's own (kernel_trees.py grids, same trees):
  llama_serve:   llama8b "b=256 P=2048 S=128", `prefix1x2k_c256`'s decode batch (H100: ours
                 132 µs, 35.7 % of roofline, 2.2x FlashInfer decode; its chunk-first launch
                 60 µs at 18.7 % of the GEMM peak, the most compute-bound point of the grid: is
                 it the tensor pipe, shared memory, L2 or the barriers?)
  paper_shared:  paper "n_p=4096 n_s=4096": b=32, 32/32 heads, fp16, block 64 (27.6 % of roofline)
  paper_private: paper "n_p=4096 n_s=0", nothing shared (0.85x FlashInfer decode)
  llama_capacity: llama8b "b=32 P=4096 S=128", the plan padded as for a CUDA graph (its CTAs
                  choose their KV splits from the real plan)"""
from __future__ import annotations

import csv
import re
import sys

POINTS = {
    # name: (grid, point label in it, capacity plan)
    "llama_serve": ("llama8b", "b=256 P=2048 S=128", False),
    "paper_shared": ("paper", "n_p=4096 n_s=4096", False),
    "paper_private": ("paper", "n_p=4096 n_s=0", False),
    "llama_capacity": ("llama8b", "b=32 P=4096 S=128", True),
}
# Nsight Compute's names of the few metrics the table keeps (section "details" page).
# "Max Bandwidth": the busiest of the memory units (L1, L2, DRAM), so with DRAM low it says whether
# the chunk CTAs' re-reads of a node from L2 are the ceiling; "Issue Slots Busy": how often a
# warp scheduler issued at all.
METRICS = ("Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput",
           "Achieved Occupancy", "Registers Per Thread", "Grid Size", "L2 Hit Rate",
           "Max Bandwidth", "Issue Slots Busy")


def run_point(name: str) -> None:
    import torch

    from vllm_chunkattn.bench.contenders import ours
    from vllm_chunkattn.bench.kv_pool import KvPool
    from vllm_chunkattn.bench.kernel_gpu import ours_capacity_mode
    from vllm_chunkattn.bench.kernel_trees import grid_points, pool_blocks, tree_block_table
    from vllm_chunkattn.plan import build_plan

    grid, label, capacity = POINTS[name]
    point = next(p for p in grid_points(grid) if p.label == label)
    shape, bs = point.shape, point.shape.block_size
    pool = KvPool(pool_blocks([point]), bs, shape.num_kv_heads, shape.head_size,
                  getattr(torch, shape.dtype), "cuda", "paged_nhd")
    gen = torch.Generator().manual_seed(0)
    table, lens = tree_block_table(point, pool.kv_cache.shape[0], gen)
    bt = pool.from_table(table, lens, shape.num_heads, gen)
    fn = ours_capacity_mode(bt, bs) if capacity else ours(bt, build_plan(table, lens, bs))
    fn()
    torch.cuda.synchronize()


def launches(path: str) -> dict[str, dict[str, str]] | None:
    """'<launch id> <kernel>' -> metric name -> 'value unit' from one ncu --csv --page details
    log; None if it holds no profiled kernel."""
    try:
        with open(path, newline="") as f:
            rows = [r for r in csv.reader(f) if r]
    except OSError:
        rows = []
    header = next((i for i, r in enumerate(rows) if "Metric Name" in r), None)
    if header is None:
        return None
    cols = {c: i for i, c in enumerate(rows[header])}
    last = max(cols[c] for c in ("ID", "Kernel Name", "Grid Size", "Metric Name", "Metric Unit",
                                 "Metric Value"))
    by_launch: dict[str, dict[str, str]] = {}
    for r in rows[header + 1:]:
        if len(r) <= last:   # ncu's own lines between the launches' rows
            continue
        key = f"{r[cols['ID']]} {r[cols['Kernel Name']].split('<')[0].split('(')[0]}"
        metric, unit = r[cols["Metric Name"]], r[cols["Metric Unit"]]
        by_launch.setdefault(key, {"Grid Size": r[cols["Grid Size"]]})[metric] = \
            f"{r[cols['Metric Value']]} {unit}".strip()
    return by_launch


STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio")


def summary(paths: list[str]) -> str:
    """The METRICS table of the ncu_<point>.csv logs, then the stall reasons of the
    ncu_stalls_<point>.csv ones (largest first: warps stalled for it per issued instruction)."""
    lines = ["| point | kernel | " + " | ".join(METRICS) + " |",
             "|---|---|" + "---|" * len(METRICS)]
    stalls = ["", "Warp stall reasons (warps stalled per issued instruction, the six largest):", "",
              "| point | kernel | stall reasons |", "|---|---|---|"]
    for path in paths:
        point = path.rsplit("/", 1)[-1].removesuffix(".csv").removeprefix("ncu_")
        by_launch = launches(path)
        is_stalls = point.startswith("stalls_")
        point = point.removeprefix("stalls_")
        if by_launch is None:
            (stalls if is_stalls else lines).append(
                f"| {point} | (no kernels profiled) |" + (" |" if is_stalls else " |" * len(METRICS)))
            continue
        for key, m in by_launch.items():
            kernel = key.split(" ", 1)[1]
            if not is_stalls:
                lines.append(f"| {point} | {kernel} | " + " | ".join(m.get(x, "") for x in METRICS) + " |")
                continue
            reasons = sorted(((float(v.split()[0].replace(",", "")), STALL.fullmatch(k).group(1))
                              for k, v in m.items() if STALL.fullmatch(k)), reverse=True)
            stalls.append(f"| {point} | {kernel} | "
                          + ", ".join(f"{name} {v:.2f}" for v, name in reasons[:6]) + " |")
    return "\n".join(lines + (stalls if len(stalls) > 5 else []))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--summary"]:
        print(summary(argv[1:]))
        return 0
    if len(argv) != 1 or argv[0] not in POINTS:
        print(f"usage: ncu_points.py {{{','.join(POINTS)}}} | --summary CSV...", file=sys.stderr)
        return 2
    run_point(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
