"""Stock vLLM vs --attention-backend CUSTOM on each family test model (models.py) in fp32:
identical greedy and seeded-sampled tokens, logprobs within 1e-3, on prompts that share a prefix
longer than every window and end in distinct suffixes, with the native kernel serving; and
under preemption in a pool too small for the batch."""
import json

import pytest

from families.models import FAMILIES, token_prompts, vllm_job
from vllm_runs import assert_native_kernel, assert_not_custom, assert_same_outputs, run_llm

pytestmark = pytest.mark.vllm


def prompts() -> tuple[list[list[int]], list[list[int]]]:
    prefix, *suffixes = token_prompts(11, (150, 5, 17, 33, 48))
    return [prefix + s for s in suffixes], [prefix + suffixes[0]]


def job(name, backend):
    greedy, sampled = prompts()
    return vllm_job(name, [
        {"prompts": greedy,
         "sampling": dict(temperature=0.0, max_tokens=24, logprobs=0, ignore_eos=True)},
        {"prompts": sampled,
         "sampling": dict(temperature=0.8, n=3, seed=1234, max_tokens=24, logprobs=0,
                          ignore_eos=True)},
    ], backend)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_custom_matches_stock_on_family(name, tmp_path):
    stock = run_llm(job(name, None), tmp_path)
    custom = run_llm(job(name, "CUSTOM"), tmp_path)
    assert_not_custom(stock["log"])
    assert_native_kernel(custom["log"])
    assert_same_outputs(stock, custom, atol=1e-3)
    assert len({tuple(c["token_ids"]) for c in custom["groups"][1][0]}) > 1   # n=3 diverge


# 32 blocks of vLLM's hybrid layout for these models (a block of each KV cache tensor, shared
# by one full and one windowed layer): 2 MiB of fp32 KV.
SMALL_KV_BYTES = 32 * 2 * (2 * 32 * 2 * 64 * 4)


@pytest.mark.parametrize("name", ["gpt-oss", "gemma2", "mistral-sw"])
def test_custom_matches_stock_under_preemption(name, tmp_path):
    """Four prompts of ~200 tokens that each grow by 160, in 2 MiB of KV cache, too little
    for the batch: both preempt and recompute, the tokens stay stock's. gpt-oss and Gemma 2
    (full and windowed layers) run in vLLM's hybrid KV cache groups with the tree as with stock;
    with --disable-hybrid-kv-cache-manager (windowed layers at full length, half the blocks in
    the same memory) the tree preempts more. Mistral (every layer
    windowed) keeps every token's KV: in 20 blocks to stock's 40, the same tokens."""
    greedy, _ = prompts()
    groups = [{"prompts": greedy,
               "sampling": dict(temperature=0.0, max_tokens=160, logprobs=0, ignore_eos=True)}]
    hybrid = name != "mistral-sw"
    variants = {"stock": None, "custom": "CUSTOM"} | ({"full-length": "CUSTOM"} if hybrid else {})
    runs = {}
    for variant, backend in variants.items():
        job = vllm_job(name, groups, backend)
        job["engine"].update(max_model_len=384, disable_log_stats=False)
        if hybrid:
            job["engine"]["kv_cache_memory_bytes"] = SMALL_KV_BYTES
        else:       # stock frees what leaves the window: give it 40 blocks, the tree 20
            job["engine"]["num_gpu_blocks_override"] = 20 if backend else 40
        if variant == "full-length":
            job["engine"]["disable_hybrid_kv_cache_manager"] = True
        job["metrics"] = ["vllm:num_preemptions"]
        stats = tmp_path / f"tree-{variant}.json"
        runs[variant] = run_llm(job, tmp_path, env={
            "CHUNKATTN_TREE_STATS_FILE": str(stats), "CHUNKATTN_STATS_INTERVAL_S": "0",
            "CHUNKATTN_DEBUG_TREE": "1"} if backend else None)
        if backend:
            assert_native_kernel(runs[variant]["log"])
            tree = json.loads(stats.read_text())
            assert tree["invariant_checks"] >= tree["steps"] > 0
    stock, custom = runs["stock"], runs["custom"]
    assert_same_outputs(stock, custom, atol=1e-3)
    preempted = {v: r["metrics"]["vllm:num_preemptions"] for v, r in runs.items()}
    assert preempted["custom"] > 0, preempted               # the pool really was too small
    if hybrid:
        # Stock's count differs by eviction order (tests/plugin/test_window_groups.py).
        assert preempted["full-length"] > preempted["custom"], preempted
        assert_same_outputs(stock, runs["full-length"], atol=1e-3)
