"""Speculative decoding with an EAGLE draft head: stock vLLM vs --attention-backend CUSTOM with the
same speculative config, tiny fp32 model, greedy. The drafter's attention layer runs vLLM's own
backend on the blocks the tree hands out (lookahead slots pending in the tree); the target's
verify rows run TPP. The same tokens, logprobs within 1e-3, the same prefix-cache hits (the last
matched block is recomputed for the drafter, as vLLM does) and, with an ample pool, the same
drafted and accepted counts; under preemption the same tokens. Synchronously scheduled (vLLM on
CPU), and with async scheduling and the V2 model runner, as vLLM runs EAGLE on a GPU (drafts
proposed on the device a step ahead, their slots pending in the tree)."""
import pytest

from eagle_draft import eagle_draft
from vllm_runs import GPU_DEFAULTS, assert_native_kernel, assert_not_custom, \
    assert_same_outputs, run_llm, tiny_model
from test_speculative import prompts

pytestmark = pytest.mark.vllm
METRICS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
           "vllm:prefix_cache_hits", "vllm:num_preemptions")


def job(backend, groups, **engine):
    spec = {"method": "eagle", "model": str(eagle_draft()), "num_speculative_tokens": 3}
    return {"engine": {**dict(model=str(tiny_model()), dtype="float32",
                              attention_backend=backend, block_size=32, max_model_len=1024,
                              enforce_eager=True, kv_cache_memory_bytes=64 << 20, seed=0,
                              disable_log_stats=False, speculative_config=spec), **engine},
            "groups": groups, "metrics": list(METRICS)}


SCHEDULING = {"sync": ({}, {}), "async": ({"async_scheduling": True}, GPU_DEFAULTS)}


def run_both(tmp_path, groups, scheduling, env=None, **engine):
    engine_args, mode_env = SCHEDULING[scheduling]
    engine.update(engine_args)
    stock = run_llm(job(None, groups, **engine), tmp_path, env=mode_env)
    custom = run_llm(job("CUSTOM", groups, **engine), tmp_path, env={**mode_env, **(env or {})})
    assert_not_custom(stock["log"])
    assert_native_kernel(custom["log"])
    assert f"async scheduling {'on' if scheduling == 'async' else 'off'}" in custom["log"]
    assert_same_outputs(stock, custom, atol=1e-3)
    return stock["metrics"], custom["metrics"]


def greedy(max_tokens):
    return dict(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_eagle_speculation_matches_stock(scheduling, tmp_path):
    """One request first, so the others hit its cached system prompt."""
    batch, _ = prompts()
    groups = [{"prompts": batch[:1], "sampling": greedy(8)},
              {"prompts": batch, "sampling": greedy(40)}]
    stock, custom = run_both(tmp_path, groups, scheduling)
    assert custom == stock, (custom, stock)
    assert 0 < stock["vllm:spec_decode_num_accepted_tokens"] \
        < stock["vllm:spec_decode_num_draft_tokens"], stock
    assert stock["vllm:prefix_cache_hits"] > 0, stock


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_eagle_speculation_under_preemption_matches_stock(scheduling, tmp_path):
    """A pool of ~500 tokens for five ~200-token sequences with drafts and lookahead slots in
    flight: requests are preempted and recomputed; the tree's invariants hold every step and
    nothing is left in use."""
    batch, _ = prompts()
    tree_file = tmp_path / "tree.json"
    stock, custom = run_both(tmp_path, [{"prompts": batch, "sampling": greedy(60)}], scheduling,
                             env={
        "CHUNKATTN_TREE_STATS_FILE": str(tree_file), "CHUNKATTN_STATS_INTERVAL_S": "0",
        "CHUNKATTN_DEBUG_TREE": "1"}, kv_cache_memory_bytes=3 << 20, max_model_len=256)
    assert stock["vllm:num_preemptions"] > 0 and custom["vllm:num_preemptions"] > 0
    import json
    tree = json.loads(tree_file.read_text())
    assert tree["invariant_checks"] >= tree["steps"] > 0
    assert tree["in_use_blocks"] == 0, tree
