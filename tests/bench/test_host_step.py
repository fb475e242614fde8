"""bench host's arithmetic: nested parts subtracted once, the step's remainder as "other", a run
slowed by another job dropped by the median."""
from types import SimpleNamespace

import pytest

from vllm_chunkattn.bench import host_step


def ms(**parts):
    out = {p: 0.0 for p in host_step.PARTS}
    out.update({k.replace("__", "."): v for k, v in parts.items()})
    return out


def test_nested_parts_are_subtracted_from_their_parents():
    m = ms(step=10.0, runner__model_forward=6.0, attention__forward=2.0,
           runner__update_states=0.5, runner__reorder_batch=0.2, scheduler__schedule=1.0)
    ex = host_step.exclusive(m)
    assert ex["runner.model_forward"] == pytest.approx(4.0)
    assert ex["runner.update_states"] == pytest.approx(0.3)
    # other = step - top-level parts (forward 6, update 0.5, schedule 1): 2.5
    assert ex["other"] == pytest.approx(2.5)
    assert sum(ex.values()) == pytest.approx(10.0)      # the parts add up to the step


def test_the_median_drops_a_slowed_run_and_the_report_sums_host_work():
    fast = ms(step=10.0, runner__model_forward=6.0, attention__forward=2.0, scheduler__schedule=1)
    slow = ms(step=30.0, runner__model_forward=18.0, attention__forward=6.0, scheduler__schedule=3)
    run = lambda m: {"ms_per_step": m, "cpu_ms_per_step": m, "steps": 10, "tokens": 100,
                     "seconds": m["step"] / 100}
    runs = {"stock": [run(fast), run(fast), run(slow)], "custom": [run(fast)] * 3}
    assert host_step.median_parts(runs["stock"], "ms_per_step")["scheduler.schedule"] == 1
    a = SimpleNamespace(tag="t", dtype="float32", prompts=32, prompt_len=200, range_ratio=0.5,
                        output_len=128, repeats=3)
    report = host_step.write_report(runs, a, "m", "cmd", "0")
    # host work = step 10 - forward 6 (attention inside it): 4.000 for both
    assert "| **host work** (step − forward) | 4.000 | 4.000 | +0.000 |" in report
    assert "| **step** | 10.000 | 10.000 | +0.000 |" in report
