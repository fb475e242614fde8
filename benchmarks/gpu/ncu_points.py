"""Hardware counters of our CUDA kernels at the points the first H200 run left furthest from
their goals (issue #9), for Nsight Compute: run_on_device.sh runs each point in its own
`ncu -k regex:tpp_` process and `--summary` turns the CSVs into one table.

  python benchmarks/gpu/ncu_points.py POINT          # one call of our op at POINT (under ncu)
  python benchmarks/gpu/ncu_points.py --summary CSV...   # DRAM %, occupancy, ... per kernel

Points (one layer, one decode step):
  paper_shared:  b=32, 32/32 heads, d 128, fp16, block 64, 4096 of 4096 shared (27.6 % of roofline)
  paper_private: the same with nothing shared (0.85x FlashInfer decode)
  llama_capacity: b=32, 32/8 heads, bf16, block 16, 4096 shared + 128 private, the plan padded as
                  for a CUDA graph (was 0.23x eager: the KV splits its CTAs now choose)"""
from __future__ import annotations

import csv
import sys

POINTS = {
    # name: (shape, n_p, n_s, rows, capacity plan)
    "paper_shared": ("PAPER", 4096, 4096, 32, False),
    "paper_private": ("PAPER", 4096, 0, 32, False),
    "llama_capacity": ("LLAMA3_8B", 4096 + 128, 4096, 32, True),
}
# Nsight Compute's names of the few metrics the table keeps (section "details" page).
METRICS = ("Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput",
           "Achieved Occupancy", "Registers Per Thread", "Grid Size")


def run_point(name: str) -> None:
    import torch

    from vllm_chunkattn.bench import kernel_trees
    from vllm_chunkattn.bench.kernel import KvPool, ours
    from vllm_chunkattn.bench.kernel_gpu import ours_capacity_mode
    from vllm_chunkattn.plan import build_plan

    shape_name, n_p, n_s, rows, capacity = POINTS[name]
    shape = getattr(kernel_trees, shape_name)
    bs = shape.block_size
    blocks = n_s // bs + rows * -(-(n_p + 1 - n_s) // bs) + 1
    pool = KvPool(blocks, bs, shape.num_kv_heads, shape.head_size, getattr(torch, shape.dtype),
                  "cuda", "paged_nhd")
    bt = pool.batch(n_p, n_s, rows, shape.num_heads, seed=0)
    fn = (ours_capacity_mode(bt, bs) if capacity
          else ours(bt, build_plan(bt.block_table.cpu(), bt.seq_lens.cpu(), bs)))
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
