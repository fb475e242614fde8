"""Hardware counters of our CUDA kernels at the points the first H200 run left furthest from
their goals (issue #9), for Nsight Compute: run_on_device.sh runs each point in its own
`ncu -k regex:tpp_` process and `--summary` turns the CSVs into one table.

  python benchmarks/gpu/ncu_points.py POINT          # one call of our op at POINT (under ncu)
  python benchmarks/gpu/ncu_points.py --summary CSV...   # DRAM %, occupancy, ... per kernel

Points (one layer, one decode step), the bench's own (kernel_trees.py grids, same trees):
  paper_shared:  paper "n_p=4096 n_s=4096": b=32, 32/32 heads, fp16, block 64 (27.6 % of roofline)
  paper_private: paper "n_p=4096 n_s=0", nothing shared (0.85x FlashInfer decode)
  llama_capacity: llama8b "b=32 P=4096 S=128", the plan padded as for a CUDA graph (was 0.23x
                  eager: the KV splits its CTAs now choose)"""
from __future__ import annotations

import csv
import sys

POINTS = {
    # name: (grid, point label in it, capacity plan)
    "paper_shared": ("paper", "n_p=4096 n_s=4096", False),
    "paper_private": ("paper", "n_p=4096 n_s=0", False),
    "llama_capacity": ("llama8b", "b=32 P=4096 S=128", True),
}
# Nsight Compute's names of the few metrics the table keeps (section "details" page).
METRICS = ("Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput",
           "Achieved Occupancy", "Registers Per Thread", "Grid Size")


def run_point(name: str) -> None:
    import torch

    from vllm_chunkattn.bench.kernel import KvPool, ours
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


def summary(paths: list[str]) -> str:
    lines = ["| point | kernel | " + " | ".join(METRICS) + " |",
             "|---|---|" + "---|" * len(METRICS)]
    for path in paths:
        point = path.rsplit("/", 1)[-1].removesuffix(".csv").removeprefix("ncu_")
        by_launch: dict[str, dict[str, str]] = {}
        try:
            with open(path, newline="") as f:
                rows = [r for r in csv.reader(f) if r]
        except OSError:
            rows = []
        header = next((i for i, r in enumerate(rows) if "Metric Name" in r), None)
        if header is None:
            lines.append(f"| {point} | (no kernels profiled) |" + " |" * len(METRICS))
            continue
        cols = {c: i for i, c in enumerate(rows[header])}
        for r in rows[header + 1:]:
            key = f"{r[cols['ID']]} {r[cols['Kernel Name']].split('<')[0].split('(')[0]}"
            metric, unit = r[cols["Metric Name"]], r[cols["Metric Unit"]]
            by_launch.setdefault(key, {"Grid Size": r[cols["Grid Size"]]})[metric] = \
                f"{r[cols['Metric Value']]} {unit}".strip()
        for key, m in by_launch.items():
            lines.append(f"| {point} | {key.split(' ', 1)[1]} | "
                         + " | ".join(m.get(x, "") for x in METRICS) + " |")
    return "\n".join(lines)


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
