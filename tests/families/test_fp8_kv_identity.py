"""An fp8 KV cache with the flag: CUSTOM gives stock vLLM's tokens and logprobs at the same
`kv_cache_dtype` (e4m3 and e5m2), on models with peaky attention (the family checkpoints:
gpt-oss's sinks and windows, Phi-3's head size 96), in fp32, with shared prefixes and n > 1,
and under preemption (bf16 queries on fp8 caches: tests/kernels/test_fp8_kv_cache.py). The fp8 cache really is used: the same model with a 32-bit cache
gives other logprobs."""
import json

import pytest

from families.models import vllm_job
from families.test_family_identity import job, prompts
from vllm_runs import (NEEDS_CPU_FP8, assert_native_kernel, assert_not_custom, assert_same_outputs,
                       run_llm)

pytestmark = [pytest.mark.vllm, NEEDS_CPU_FP8]


def _fp8_job(name, backend, cache_dtype, dtype="float32"):
    j = job(name, backend)
    j["engine"].update(kv_cache_dtype=cache_dtype, dtype=dtype)
    return j


def _max_logprob_diff(a, b):
    return max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"]))


@pytest.mark.parametrize("name,cache_dtype,dtype,tol", [
    ("gpt-oss", "fp8", "float32", 1e-3),
    ("gpt-oss", "fp8_e5m2", "float32", 1e-3),
    ("phi3-hd96", "fp8_e4m3", "float32", 1e-3),
])
def test_custom_matches_stock_with_fp8_kv_cache(name, cache_dtype, dtype, tol, tmp_path):
    stock = run_llm(_fp8_job(name, None, cache_dtype, dtype), tmp_path)
    custom = run_llm(_fp8_job(name, "CUSTOM", cache_dtype, dtype), tmp_path)
    assert_not_custom(stock["log"])
    assert_native_kernel(custom["log"])
    assert_same_outputs(stock, custom, atol=tol)
    if cache_dtype == "fp8" and name == "gpt-oss":
        full = run_llm(job(name, "CUSTOM"), tmp_path)         # the same, with a 32-bit cache
        diffs = [_max_logprob_diff(a[0], b[0])
                 for a, b in zip(full["groups"][0], custom["groups"][0])]
        assert max(diffs) > 1e-2, diffs


def test_custom_matches_stock_with_fp8_kv_cache_under_preemption(tmp_path):
    """gpt-oss with an fp8 cache of 32 blocks (hybrid: full and windowed layers in separate
    groups, in both) for four prompts that each grow by 160 tokens: the tree preempts and
    recomputes into the fp8 cache, the tokens stay stock's. Over 160 tokens
    the logprobs drift further than with a 32-bit cache: a K or V written from a hidden state
    that differs in its last fp32 bits can round to the next fp8 value, a 6 % step."""
    greedy, _ = prompts()
    groups = [{"prompts": greedy,
               "sampling": dict(temperature=0.0, max_tokens=160, logprobs=0, ignore_eos=True)}]
    jobs = {b: vllm_job("gpt-oss", groups, b) for b in (None, "CUSTOM")}
    for backend in (None, "CUSTOM"):
        jobs[backend]["engine"].update(num_gpu_blocks_override=32, max_model_len=384,
                                       kv_cache_dtype="fp8")
    stock = run_llm(jobs[None], tmp_path)
    custom = run_llm(jobs["CUSTOM"], tmp_path, env={
        "CHUNKATTN_TREE_STATS_FILE": str(tmp_path / "tree.json"),
        "CHUNKATTN_STATS_INTERVAL_S": "0", "CHUNKATTN_DEBUG_TREE": "1"})
    assert_native_kernel(custom["log"])
    assert_same_outputs(stock, custom, atol=1e-2)
    tree = json.loads((tmp_path / "tree.json").read_text())
    assert tree["preemptions"] > 0, tree
    assert tree["invariant_checks"] >= tree["steps"] > 0
