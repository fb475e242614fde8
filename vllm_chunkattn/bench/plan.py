"""Plan build cost: a full rebuild (build_plan) vs a lazy step that reuses the plan (PlanCache
compares the block table's full blocks and finds nothing changed), per decode step; and a decode
run, where rows fill blocks on different steps: how often PlanCache rebuilds, and its host time.

    python -m vllm_chunkattn.bench plan [--requests 32 256 1024] [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ..plan import build_plan
from ..plan_cache import PlanCache
from .provenance import git_commit, load_average, machine

SHAPES = {  # name: (prefixes, shared tokens, private tokens)
    "16 prompts x n samples, 2048 shared": (16, 2048, 200),
    "1 system prompt, 1024 shared": (1, 1024, 300),
    "no sharing, 1024 private": (0, 0, 1024),
}


def batch(num_requests: int, prefixes: int, shared: int, private: int, block_size: int, seed=0):
    rng = np.random.default_rng(seed)
    shared_blocks, private_blocks = shared // block_size, -(-private // block_size)
    width = shared_blocks + private_blocks
    table = np.zeros((num_requests, width), np.int32)
    next_id = 1
    prefix_ids = []
    for _ in range(max(prefixes, 1)):
        prefix_ids.append(np.arange(next_id, next_id + shared_blocks))
        next_id += shared_blocks
    for r in range(num_requests):
        table[r, :shared_blocks] = prefix_ids[r % max(prefixes, 1)]
        table[r, shared_blocks:] = np.arange(next_id, next_id + private_blocks)
        next_id += private_blocks
    seq_lens = np.full(num_requests, shared + private, np.int32)
    perm = rng.permutation(num_requests)          # vLLM's batch order is not tree order
    return table[perm], seq_lens[perm]


def decode_run(table: np.ndarray, seq_lens: np.ndarray, block_size: int, steps: int, seed=0):
    """Decode `steps` tokens for every row, starting at lengths staggered over one block (rows
    fill blocks on different steps, as in serving), each filled block followed by a fresh one.
    Returns (PlanCache's rebuilds, rebuilds of a key on every row's full-block count (the
    lazy copy before PlanKey), mean us of PlanCache.get per step)."""
    rng = np.random.default_rng(seed)
    lens = seq_lens.astype(np.int64) + rng.integers(0, block_size, size=len(seq_lens))
    blocks = -(-(lens + steps) // block_size)
    table = np.concatenate([table, np.zeros((len(lens), int(blocks.max()) - table.shape[1] + 1),
                                            np.int32)], axis=1)
    next_id = int(table.max()) + 1
    cache, count_key_builds, total = PlanCache(block_size), 0, 0.0
    for step in range(steps):
        t = time.perf_counter()
        plan = cache.get(table, lens)
        total += time.perf_counter() - t
        fills = lens % block_size == 0              # the new token starts a block
        # (that key kept the empty plan on the row count alone, as PlanKey does)
        count_key_builds += step == 0 or (plan.num_nodes > 0
                                          and bool((lens % block_size == 1).any()))
        for r in np.flatnonzero(fills):
            table[r, lens[r] // block_size] = next_id
            next_id += 1
        lens += 1
    return cache.num_builds, count_key_builds, total / steps * 1e6


def median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, nargs="+", default=[32, 256, 1024])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--steps", type=int, default=64, help="decode steps of the decode run")
    p.add_argument("--out", default=None, help="write plan_build.md here")
    args = p.parse_args(argv)
    rows = []
    for name, (prefixes, shared, private) in SHAPES.items():
        for n in args.requests:
            bt, sl = batch(n, prefixes, shared, private, args.block_size)
            cache = PlanCache(args.block_size)
            cache.get(bt, sl)
            rebuild = median_us(lambda: build_plan(bt, sl, args.block_size), args.repeats)
            reuse = median_us(lambda: cache.get(bt, sl), args.repeats)
            plan = cache.get(bt, sl)
            rows.append((name, n, bt.shape[1], plan.num_nodes, rebuild, reuse, rebuild / reuse,
                         *decode_run(bt, sl, args.block_size, args.steps)))
    cmd = "python -m vllm_chunkattn.bench plan " + " ".join(argv or sys.argv[1:])
    lines = [f"# Plan build cost (block size {args.block_size})", "",
             f"`{cmd.strip()}`", "",
             f"Machine: {machine()}, Python {platform.python_version()}, load average "
             f"{load_average()}, commit {git_commit()}; medians of {args.repeats}.", "",
             f"- rebuild: build_plan; lazy reuse: PlanCache.get on an unchanged table.",
             f"- decode run: {args.steps} steps, row lengths staggered over one block (rows fill "
             "blocks on different steps), a fresh block after each filled one; rebuilds by "
             "PlanCache, and by a key on every row's full-block count (the rule before PlanKey: "
             "any row filling a block rebuilds); µs/step: PlanCache.get's mean over the run.", "",
             "| batch | requests | blocks/row | nodes | rebuild µs | lazy reuse µs | ratio "
             "| run rebuilds | full-count key rebuilds | run µs/step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.0f} | {r[5]:.0f} | {r[6]:.1f}× "
              f"| {r[7]} | {r[8]} | {r[9]:.0f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "plan_build.md").write_text(text)
    return 0
