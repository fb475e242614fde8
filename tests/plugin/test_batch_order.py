"""The decode-first reorder's shortcut (plugin/batch_order.py) does exactly what vLLM's
reorder_batch_to_split_decodes_and_prefills does, on batches of every kind."""
import random
from types import SimpleNamespace

import numpy as np
import pytest

from vllm.v1.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills
from vllm_chunkattn.plugin.batch_order import decode_first


class Batch:
    """What the reorder reads and moves of vLLM's InputBatch."""

    def __init__(self, computed, prompt):
        self.req_ids = [f"r{i}" for i in range(len(computed))]
        self.num_computed_tokens_cpu = np.array(computed + [0] * 4, np.int32)  # + spare slots
        self.num_prompt_tokens = np.array(prompt + [0] * 4, np.int32)
        self.swaps = []

    def swap_states(self, i, j):
        self.swaps.append((i, j))
        for a in (self.req_ids, self.num_computed_tokens_cpu, self.num_prompt_tokens):
            a[i], a[j] = a[j], a[i]


def batch(rng, num_reqs, kind):
    computed, prompt, scheduled = [], [], {}
    for i in range(num_reqs):
        p = rng.randint(1, 300)
        row = kind if kind != "mixed" else rng.choice(["decode", "prefill", "chunk", "short"])
        if row == "decode":
            c, n = p + rng.randint(0, 50), 1
        elif row == "prefill":
            c, n = 0, rng.randint(1, p)
        elif row == "chunk":                   # chunked prefill: context, several tokens
            c = rng.randint(1, p) if p > 1 else 1
            n = max(1, p - c)
        else:                                  # short extend: context, one token, prompt left
            c, n = (rng.randint(1, p - 1), 1) if p > 1 else (p, 1)
        computed.append(c)
        prompt.append(p)
        scheduled[f"r{i}"] = n
    out = SimpleNamespace(num_scheduled_tokens=scheduled,
                          total_num_scheduled_tokens=sum(scheduled.values()))
    return computed, prompt, out


@pytest.mark.parametrize("kind", ["decode", "mixed", "prefill", "short"])
def test_the_shortcut_reorders_as_vllm_does(kind):
    rng = random.Random(kind)
    shortcut = decode_first(reorder_batch_to_split_decodes_and_prefills)
    taken = 0
    for trial in range(300):
        computed, prompt, out = batch(rng, rng.randint(0, 12), kind)
        ours, theirs = Batch(computed, prompt), Batch(computed, prompt)
        for threshold in (1, 2):
            assert (shortcut(ours, out, decode_threshold=threshold)
                    == reorder_batch_to_split_decodes_and_prefills(theirs, out,
                                                                   decode_threshold=threshold))
            assert ours.req_ids == theirs.req_ids and ours.swaps == theirs.swaps
        taken += kind == "decode" and not ours.swaps
    if kind == "decode":
        assert taken == 300      # an all-decode batch never moves


def test_an_all_decode_step_never_reaches_vllms_function():
    def vllm_reorder(*args, **kwargs):
        raise AssertionError("called")
    shortcut = decode_first(vllm_reorder)
    computed, prompt, out = batch(random.Random(0), 32, "decode")
    assert shortcut(Batch(computed, prompt), out, decode_threshold=1) is False
    computed, prompt, out = batch(random.Random(0), 32, "prefill")
    with pytest.raises(AssertionError, match="called"):      # anything else: vLLM's own
        shortcut(Batch(computed, prompt), out, decode_threshold=1)


def test_the_builder_installs_the_shortcut_where_the_runner_calls_it():
    from vllm.v1.worker import gpu_model_runner
    from vllm_chunkattn.plugin import batch_order
    batch_order.install()
    batch_order.install()                                     # idempotent
    wrapped = gpu_model_runner.reorder_batch_to_split_decodes_and_prefills
    assert wrapped._chunkattn_wrapped and wrapped.__wrapped__ is \
        reorder_batch_to_split_decodes_and_prefills
