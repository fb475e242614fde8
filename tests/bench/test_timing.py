"""bench/timing.py: contenders timed side by side in ABBA rounds (CPU clock; the CUDA path differs
only in how one call is timed)."""
import os
import time
from types import SimpleNamespace

import torch

from vllm_chunkattn.bench.timing import Timer, Variant

CPU = torch.device("cpu")


def recorder(log, name):
    return lambda: log.append(name)


def test_the_order_reverses_every_round():
    log = []
    timed = Timer(CPU).side_by_side({n: recorder(log, n) for n in "ABC"}, reps=8, warmup=False)
    assert log == list("AABBCC" "CCBBAA" "AABBCC" "CCBBAA")
    assert set(timed) == set("ABC")


def test_warm_up_runs_each_once_before_the_rounds():
    log = []
    Timer(CPU).side_by_side({n: recorder(log, n) for n in "AB"}, reps=2)
    assert log == list("AB" "AB" "BA")      # warm-up, then 2 rounds of 1 repeat


def test_machine_drift_falls_on_both_contenders_alike(monkeypatch):
    """Two identical contenders on a machine that slows down by 2 ms every call: timed one after
    the other the second looks far slower; side by side their medians agree. The Timer reads a
    virtual clock each call advances by its drifted time: sleeping that long instead read 1.28
    side by side once, the sleeps' wake-ups late on a loaded machine (CI's two test workers)."""
    from vllm_chunkattn.bench import timing

    now = [0.0]
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    calls = []

    def drifting():
        now[0] += 0.001 + 0.002 * len(calls)
        calls.append(1)

    def ratio(rounds):
        calls.clear()
        timed = Timer(CPU).side_by_side({"A": drifting, "B": drifting}, reps=8, warmup=False,
                                        time_limit_s=60, rounds=rounds)
        return timed["B"] / timed["A"]

    assert ratio(rounds=1) > 2.0            # A's 8 calls, then B's: the drift shows as a gap
    assert 0.85 < ratio(rounds=4) < 1.18


def test_a_slow_contender_stops_at_its_time_limit_with_three_repeats_at_least():
    counts = {"slow": 0, "fast": 0}

    def count(name, seconds):
        def fn():
            counts[name] += 1
            time.sleep(seconds)
        return fn

    Timer(CPU).side_by_side({"slow": count("slow", 0.03), "fast": count("fast", 0)},
                            reps=100, time_limit_s=0.05, warmup=False)
    assert 3 <= counts["slow"] <= 8
    assert counts["fast"] == 100
    counts["slow"] = 0
    Timer(CPU)(count("slow", 0.03), reps=100, time_limit_s=0.01, warmup=False)
    assert counts["slow"] == 3


def test_a_variant_runs_under_its_environment_and_leaves_it_as_it_was(monkeypatch):
    monkeypatch.setenv("CHUNKATTN_CHUNK_SPLITS", "5")
    monkeypatch.delenv("CHUNKATTN_OVERLAP_FINAL", raising=False)
    seen = []

    def op():
        seen.append((os.environ.get("CHUNKATTN_CHUNK_SPLITS"),
                     os.environ.get("CHUNKATTN_OVERLAP_FINAL")))

    contenders = {"plain": op,
                  "knobs": Variant(op, {"CHUNKATTN_CHUNK_SPLITS": 7, "CHUNKATTN_OVERLAP_FINAL": 0})}
    Timer(CPU).side_by_side(contenders, reps=2, warmup=False)
    assert seen == [("5", None), ("7", "0"), ("7", "0"), ("5", None)]
    assert os.environ["CHUNKATTN_CHUNK_SPLITS"] == "5"
    assert "CHUNKATTN_OVERLAP_FINAL" not in os.environ
    contenders["knobs"]()                   # called outside a timer: the same environment
    assert seen[-1] == ("7", "0") and "CHUNKATTN_OVERLAP_FINAL" not in os.environ
