"""Plan build cost: a full rebuild (build_plan) vs a lazy step that reuses the plan (PlanCache
compares the block table's full blocks and finds nothing changed), per decode step; and a decode
run, where rows fill blocks on different steps: how often PlanCache rebuilds, and its host time.

    python -m vllm_chunkattn.bench plan [--requests 32 256 1024] [--against COMMIT]
                                        [--out benchmarks/results]

--against times that commit's build_plan (vllm_chunkattn/plan.py read with git) side by side
with this one, in rounds of alternating order, after checking that both give the same plans.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..plan import build_plan
from ..plan.cache import PlanCache
from ..plan import TppPlan
from .provenance import git_commit, load_average, machine
from .timing import Timer

SHAPES = {  # name: (prefixes, shared tokens, private tokens)
    "16 prompts x n samples, 2048 shared": (16, 2048, 200),
    "1 system prompt, 1024 shared": (1, 1024, 300),
    "1 system prompt, 2048 shared + 2176 private": (1, 2048, 2176),   # bench tpot's rows
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
    block_ids = 1 + rng.permutation(next_id - 1).astype(np.int32)   # nor is its free list
    return block_ids[table[perm] - 1], seq_lens[perm]


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
        # Rows whose full blocks just grew by one; their next token starts a block.
        fills = lens % block_size == 0
        # (that key kept the empty plan on the row count alone, as PlanKey does)
        count_key_builds += step == 0 or (plan.num_nodes > 0 and bool(fills.any()))
        for r in np.flatnonzero(fills):
            table[r, lens[r] // block_size] = next_id
            next_id += 1
        lens += 1
    return cache.num_builds, count_key_builds, total / steps * 1e6


def build_plan_of(commit: str):
    """build_plan as the package had it at a git commit, as a module of its own: plan.py, or
    plan/tpp_plan.py + plan/build.py (their relative imports dropped: they need only each other)."""
    import subprocess
    import types

    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{commit}:{path}"], check=True,
                              capture_output=True, text=True, cwd=Path(__file__).parent).stdout
    try:
        src = show("vllm_chunkattn/plan.py")
    except subprocess.CalledProcessError:
        build = show("vllm_chunkattn/plan/build.py").replace("from __future__ import annotations", "")
        src = show("vllm_chunkattn/plan/tpp_plan.py") + "\n".join(
            line for line in build.splitlines() if not line.startswith("from ."))
    module = sys.modules[f"plan_{commit}"] = types.ModuleType(f"plan_{commit}")  # (dataclass)
    exec(compile(src, f"{commit}:build_plan", "exec"), module.__dict__)
    return module.build_plan


def same_plan(a, b) -> bool:
    return (a.num_seqs, a.num_nodes, a.num_partials) == (b.num_seqs, b.num_nodes, b.num_partials) \
        and all(np.array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)))
                for f in TppPlan.TENSORS)


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
    p.add_argument("--against", default=None, metavar="COMMIT",
                   help="also time this git commit's build_plan, side by side")
    p.add_argument("--out", default=None, help="write plan_build.md here")
    args = p.parse_args(argv)
    old_build_plan = build_plan_of(args.against) if args.against else None
    timer = Timer(torch.device("cpu"))
    rows, against = [], []
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
            if old_build_plan is not None:
                def old():
                    return old_build_plan(bt, sl, args.block_size)

                def new():
                    return build_plan(bt, sl, args.block_size)
                if not same_plan(old(), new()):
                    raise SystemExit(f"{name}, {n} requests: {args.against}'s build_plan gives "
                                     "another plan")
                ms = timer.side_by_side({"old": old, "new": new}, args.repeats)
                against.append((name, n, ms["old"] * 1e3, ms["new"] * 1e3))
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
    if against:
        lines += ["", f"build_plan side by side with commit {args.against}'s (same plans checked "
                  f"first; rounds of alternating order, medians of about {args.repeats}):", "",
                  f"| batch | requests | {args.against} µs | this µs | speed-up |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {a[0]} | {a[1]} | {a[2]:.0f} | {a[3]:.0f} | {a[2] / a[3]:.1f}× |"
                  for a in against]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "plan_build.md").write_text(text)
        plot(rows, against, args.against, Path(args.out) / "plan_build.png")
    return 0


def plot(rows: list, against: list, commit: str | None, path: Path) -> None:
    """Per batch shape: host µs per step against requests: a rebuild (this commit's, and the
    --against commit's) and PlanCache's mean over the decode run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = list(dict.fromkeys(r[0] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.6 * len(shapes), 3.4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if r[0] == shape]
        requests = [r[1] for r in mine]
        ax.plot(requests, [r[4] for r in mine], marker="o", label="rebuild")
        old = [a for a in against if a[0] == shape]
        if old:
            ax.plot([a[1] for a in old], [a[2] for a in old], marker="s", ls="--",
                    label=f"rebuild, {commit}")
        ax.plot(requests, [r[9] for r in mine], marker="^", label="decode run, per step")
        ax.set(xscale="log", yscale="log", title=shape, xlabel="requests", ylabel="host µs")
        ax.title.set_fontsize(7)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
