"""Timing for the kernel benchmarks: contenders timed side by side in ABBA order.

A ratio between two contenders timed one after the other also measures how the machine changed
in between (clocks, thermals, other jobs on a shared CPU). Timer.side_by_side times every
contender in rounds, the order reversed every round (A B C | C B A | A B C ...), and takes each
one's median over all its rounds, so such drift falls on every contender alike.

A Variant is a contender that is our op under environment knobs (CHUNKATTN_CHUNK_SPLITS,
CHUNKATTN_OVERLAP_FINAL, ...): the op reads them on every eager call, and they are set around
the variant's whole turn, outside the timed region, so setting them is not timed.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

ROUNDS = 4          # A B | B A | A B | B A: each contender is timed early and late


@dataclass(frozen=True)
class Variant:
    fn: Callable
    env: dict = field(default_factory=dict)     # name -> value, set for the variant's turn

    def __call__(self):
        with op_env(self.env):
            return self.fn()


@contextlib.contextmanager
def op_env(env: dict):
    """The environment variables in env set for the block, restored after."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update({name: str(value) for name, value in env.items()})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Timer:
    """Milliseconds of a call. CUDA: events, with L2 flushed before each repeat (a 256 MB write)
    so every contender reads KV from HBM as in a real step (flush_l2=False: back to back, warm).
    CPU: perf_counter."""

    def __init__(self, device: torch.device, flush_l2: bool = True):
        self.cuda = device.type == "cuda"
        self.flush = (torch.empty(256 << 20, dtype=torch.uint8, device=device)
                      if self.cuda and flush_l2 else None)

    def __call__(self, fn, reps: int, time_limit_s: float = 2.0, warmup: bool = True) -> float:
        """Median ms of fn alone (for what has nothing to be compared with in the same run)."""
        return self.side_by_side({"fn": fn}, reps, time_limit_s, warmup, rounds=1)["fn"]

    def side_by_side(self, contenders: dict, reps: int, time_limit_s: float = 2.0,
                     warmup: bool = True, rounds: int = ROUNDS) -> dict[str, float]:
        """name -> median ms over about reps repeats, in min(rounds, reps) rounds whose order
        reverses every round. A contender's turn in a round ends early once it has run longer
        than its share of time_limit_s, but every contender gets at least 3 repeats in all."""
        names = list(contenders)
        rounds = max(1, min(rounds, reps))
        per_round, least = -(-reps // rounds), -(-3 // rounds)
        if warmup:
            for name in names:
                contenders[name]()
        samples: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                samples[name] += self._turn(contenders[name], per_round, least,
                                            time_limit_s / rounds)
        return {name: statistics.median(times) for name, times in samples.items()}

    def _turn(self, contender, reps: int, least: int, time_limit_s: float) -> list[float]:
        fn, env = ((contender.fn, contender.env) if isinstance(contender, Variant)
                   else (contender, {}))
        times = []
        start = time.perf_counter()
        with op_env(env):
            for _ in range(reps):
                times.append(self._once(fn))
                if len(times) >= least and time.perf_counter() - start > time_limit_s:
                    break
        return times

    def _once(self, fn) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        if self.flush is not None:
            self.flush.zero_()
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)


def cuda_graph(fn):
    """fn captured in a CUDA graph (after a warm-up on a side stream); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out
    # The graph reads, by address, what fn holds (its TppLaunch's plan and workspace, a FlashInfer
    # wrapper's buffers), and nothing else keeps fn: freed, those blocks went to later tensors and
    # the replays would read them (wrong outputs, then an illegal address).
    replay.captured_fn = fn
    return replay
