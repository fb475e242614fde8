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


@pytest.mark.parametrize("name", ["gpt-oss", "gemma2", "mistral-sw"])
def test_custom_matches_stock_under_preemption(name, tmp_path):
    """Four prompts of ~200 tokens that each grow by 160, in a pool of 20 blocks of 32 tokens
    (640) for the tree: it preempts and recomputes, the tokens stay stock's. Stock's hybrid
    manager splits its pool between full and windowed groups, so it gets 40 blocks to hold
    one whole request in each."""
    greedy, _ = prompts()
    groups = [{"prompts": greedy,
               "sampling": dict(temperature=0.0, max_tokens=160, logprobs=0, ignore_eos=True)}]
    jobs = {b: vllm_job(name, groups, b) for b in (None, "CUSTOM")}
    jobs[None]["engine"].update(num_gpu_blocks_override=40, max_model_len=384)
    jobs["CUSTOM"]["engine"].update(num_gpu_blocks_override=20, max_model_len=384)
    stock = run_llm(jobs[None], tmp_path)
    custom = run_llm(jobs["CUSTOM"], tmp_path, env={
        "CHUNKATTN_TREE_STATS_FILE": str(tmp_path / "tree.json"), "CHUNKATTN_STATS_INTERVAL_S": "0",
        "CHUNKATTN_DEBUG_TREE": "1"})
    assert_native_kernel(custom["log"])
    assert_same_outputs(stock, custom, atol=1e-3)
    tree = json.loads((tmp_path / "tree.json").read_text())
    assert tree["preemptions"] > 0, tree                    # the pool really was too small
    assert tree["invariant_checks"] >= tree["steps"] > 0
