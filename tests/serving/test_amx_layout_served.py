"""bf16 on a CPU with AMX, at block sizes where vLLM's CPU_ATTN runs its AMX kernels: CUSTOM keeps
CPU_ATTN's AMX ISA (prefill and KV writes in its AMX layout) and TPP decode reads that layout in
place. Against stock on the same tree-shaped prompts, greedy: the same tokens up to bf16 rounding
(see assert_same_up_to_rounding), the decode really shared KV. Forcing a kernel that cannot read
the layout (CHUNKATTN_CPU_ISA=avx512) makes CUSTOM fall back to CPU_ATTN's portable layout."""
import json

import pytest
import torch

from test_vllm_equivalence import job, tree_prompts
from vllm_runs import assert_native_kernel, assert_not_custom, run_llm

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                       reason="vLLM's CPU_ATTN uses its AMX kernels only on CPUs with AMX"),
]

# The logits are bf16: a step is 1/16 for |logit| in [8, 16), and a different summation order
# may round a logit one step the other way; two steps bound a logprob's difference.
BF16_LOGPROB_ATOL = 2 / 16


def greedy_bf16_job(backend, block_size):
    j = job(backend, tree_prompts(3), block_size=block_size)
    j["engine"]["dtype"] = "bfloat16"
    j["groups"] = j["groups"][:1]           # greedy: a flip can be told from a wrong read
    return j


def assert_same_up_to_rounding(stock, custom, atol=BF16_LOGPROB_ATOL, min_agreeing=0.5):
    """Greedy bf16 outputs of two attention kernels: token by token the same, logprobs within
    atol, until the first token where they part; there the two chosen tokens must be a near tie
    (each run's chosen logprob within atol of the other's), which a rounding flip is and a wrong
    KV read is not. Nothing is compared after a flip (the contexts differ); at least min_agreeing
    of all tokens must come before one."""
    agreeing = total = 0
    for i, (a, b) in enumerate(zip(stock["groups"][0], custom["groups"][0], strict=True)):
        ta, tb = a[0]["token_ids"], b[0]["token_ids"]
        la, lb = a[0]["logprobs"], b[0]["logprobs"]
        assert len(ta) == len(tb), f"request {i}: lengths differ"
        total += len(ta)
        for k, (x, y) in enumerate(zip(ta, tb)):
            diff = abs(la[k] - lb[k])
            assert diff <= atol, (f"request {i} token {k}: logprobs {la[k]:.4f} and {lb[k]:.4f}"
                                  + (" (tokens differ: not a near tie)" if x != y else ""))
            if x != y:
                break
            agreeing += 1
    assert agreeing >= min_agreeing * total, f"only {agreeing} of {total} tokens before a flip"


@pytest.mark.parametrize("block_size", [64])
def test_amx_layout_served(block_size, tmp_path):
    stats_file = tmp_path / "stats.json"
    env = {"CHUNKATTN_STATS_FILE": str(stats_file), "CHUNKATTN_STATS_INTERVAL_S": "0"}
    stock = run_llm(greedy_bf16_job(None, block_size), tmp_path)
    custom = run_llm(greedy_bf16_job("CUSTOM", block_size), tmp_path, env=env)
    assert_not_custom(stock["log"])
    assert_native_kernel(custom["log"])
    assert "writes via CPU_ATTN (isa amx)" in custom["log"]
    assert_same_up_to_rounding(stock, custom)
    stats = json.loads(stats_file.read_text())
    assert stats["shared_kv_tokens"] > 0, stats
    # A kernel that cannot read the AMX layout: CPU_ATTN's portable one instead.
    portable = run_llm(greedy_bf16_job("CUSTOM", block_size), tmp_path,
                       env={"CHUNKATTN_CPU_ISA": "avx512"})
    assert_native_kernel(portable["log"])
    assert "writes via CPU_ATTN (isa vec)" in portable["log"]
    assert_same_up_to_rounding(stock, portable)
