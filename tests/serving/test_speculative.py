"""Speculative decoding with n-gram drafts: stock vLLM vs --attention-backend CUSTOM with the same
speculative config, on the tiny fp32 model. Prompts repeat themselves (so n-gram drafts are
proposed, some accepted and some rejected) and share a system prompt; greedy, also under
preemption in a pool too small for the batch: the same tokens, logprobs within 1e-3, the same
drafted and accepted counts (vLLM's spec-decode metrics), and the verify rows served by the TPP
kernel (its decode rows are one per query token). Seeded n > 1 sampling: stock vLLM 0.32 on CPU
does not repeat its own seeded samples with n-gram drafts (two identical runs differ: its CPU
stand-in for the sampler's expand kernel leaves the per-token temperatures uninitialized,
docs/limitations.md), so CUSTOM's samples are checked by their logprobs, which stock vLLM
without speculation scores."""
import json
import random

import pytest

from vllm_runs import (assert_native_kernel, assert_not_custom, assert_same_outputs, run_llm,
                       tiny_model)

pytestmark = pytest.mark.vllm
NUM_SPEC = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": NUM_SPEC, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
SPEC_METRICS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
VOCAB = range(3, 2048)


def prompts() -> tuple[list[list[int]], list[int]]:
    """Greedy prompts: a 100-token system prompt with a repeating phrase, then a question (some
    repeating too); and one prompt with no repeats. Every prompt leaves more than 1 + NUM_SPEC
    tokens to prefill past its cached blocks, so prefill rows never count as decodes."""
    rng = random.Random(3)
    phrase = [rng.choice(VOCAB) for _ in range(8)]
    system = phrase * 6 + [rng.choice(VOCAB) for _ in range(52)]
    questions = [[rng.choice(VOCAB) for _ in range(12 + 3 * i)] for i in range(4)]
    questions[1] = questions[1][:6] * 3
    greedy = [system + q for q in questions] + [[rng.choice(VOCAB) for _ in range(70)]]
    return greedy, system + questions[0]


def job(backend, groups, **engine):
    return {"engine": {**dict(model=str(tiny_model()), dtype="float32",
                              attention_backend=backend, block_size=32, max_model_len=1024,
                              enforce_eager=True, kv_cache_memory_bytes=64 << 20, seed=0,
                              disable_log_stats=False, speculative_config=NGRAM), **engine},
            "groups": groups, "metrics": list(SPEC_METRICS)}


def run_both(tmp_path, groups, stock_engine=None, custom_engine=None, env=None):
    stock = run_llm(job(None, groups, **(stock_engine or {})), tmp_path)
    custom = run_llm(job("CUSTOM", groups, **(custom_engine or {})), tmp_path, env=env)
    assert_not_custom(stock["log"])
    assert_native_kernel(custom["log"])
    return stock, custom


def assert_same_speculation(stock, custom) -> tuple[int, int]:
    """The same drafted and accepted counts as stock; both acceptances and rejections."""
    drafted, accepted = (stock["metrics"][name] for name in SPEC_METRICS)
    assert custom["metrics"] == stock["metrics"], (custom["metrics"], stock["metrics"])
    assert 0 < accepted < drafted, stock["metrics"]
    return drafted, accepted


@pytest.mark.parametrize("token_budget", [None, 48])
def test_ngram_speculation_matches_stock(token_budget, tmp_path):
    """token_budget 48 chunks the prompts, so steps mix verify rows with prefill chunks (some
    short enough to be decodes themselves)."""
    greedy, _ = prompts()
    groups = [{"prompts": greedy,
               "sampling": dict(temperature=0.0, max_tokens=40, logprobs=0, ignore_eos=True)}]
    stats_file, tree_file = tmp_path / "stats.json", tmp_path / "tree.json"
    engine = {"max_num_batched_tokens": token_budget} if token_budget else {}
    stock, custom = run_both(tmp_path, groups, engine, engine, env={
        "CHUNKATTN_STATS_FILE": str(stats_file), "CHUNKATTN_STATS_INTERVAL_S": "0",
        "CHUNKATTN_TREE_STATS_FILE": str(tree_file)})
    assert_same_outputs(stock, custom, atol=1e-3)
    drafted, accepted = assert_same_speculation(stock, custom)
    stats = json.loads(stats_file.read_text())
    if token_budget:
        assert stats["mixed_steps"] > 0, stats
        return
    # TPP's rows are query tokens: every decode step of a request is 1 + its drafts rows. Its
    # steps are its output tokens but the first (from the prefill) less the accepted drafts,
    # plus up to NUM_SPEC where the last step's tokens were cut at max_tokens. Verify rows
    # anywhere else (vLLM's backend) would leave only the steps' one row each.
    completions = [c for group in custom["groups"] for o in group for c in o]
    min_steps = sum(len(c["token_ids"]) - 1 for c in completions) - accepted
    assert drafted > NUM_SPEC * len(completions)
    rows = stats["decode_rows"]
    assert drafted + min_steps <= rows <= drafted + min_steps + NUM_SPEC * len(completions), (
        rows, drafted, min_steps)
    # The scheduler's count from the tree (its chunks, not the worker's block tables) predicts
    # the worker's plans: the system prompt's chunks read once for all query tokens of all
    # sharers, each row's own full chunks once for its query tokens.
    tree = json.loads(tree_file.read_text())
    assert (tree["decode_rows"], tree["decode_kv_tokens"], tree["decode_shared_kv_tokens"]) == (
        rows, stats["kv_tokens"], stats["shared_kv_tokens"]), (tree, stats)
    assert stats["shared_kv_tokens"] > 0


def test_seeded_samples_with_ngram_drafts_have_the_models_logprobs(tmp_path):
    """n=3 seeded samples of a prompt sharing the system prompt with a greedy batch (the tree
    shares its chunks); each sample's logprobs, as CUSTOM reports them while verifying drafts,
    are those stock vLLM (no speculation, its own attention) gives the same tokens."""
    greedy, sampled = prompts()
    groups = [
        {"prompts": greedy[:2],
         "sampling": dict(temperature=0.0, max_tokens=20, ignore_eos=True)},
        {"prompts": [sampled],
         "sampling": dict(temperature=0.8, n=3, seed=1234, max_tokens=40, logprobs=0,
                          ignore_eos=True)},
    ]
    custom = run_llm(job("CUSTOM", groups), tmp_path)
    assert_native_kernel(custom["log"])
    drafted, accepted = (custom["metrics"][name] for name in SPEC_METRICS)
    assert 0 < accepted < drafted, custom["metrics"]
    samples = custom["groups"][1][0]
    assert len({tuple(c["token_ids"]) for c in samples}) > 1            # n=3 diverge
    scoring = job(None, [{"prompts": [sampled + c["token_ids"] for c in samples],
                          "sampling": dict(temperature=0.0, max_tokens=1, prompt_logprobs=0)}])
    del scoring["engine"]["speculative_config"]
    scored = run_llm(scoring, tmp_path)
    assert_not_custom(scored["log"])
    for c, s in zip(samples, scored["groups"][0]):
        want = s[0]["prompt_logprobs"][-len(c["token_ids"]):]
        diff = max(abs(x - y) for x, y in zip(c["logprobs"], want))
        assert diff <= 1e-3, diff


def test_ngram_speculation_under_preemption_matches_stock(tmp_path):
    """Five prompts growing by 200 tokens each in 24 blocks of 32 tokens: requests are preempted
    with drafts in flight and recomputed. Greedy only: stock vLLM 0.32 on CPU fails seeded
    sampling resumed after a preemption (test_tree_vllm.py)."""
    greedy, _ = prompts()
    groups = [{"prompts": greedy,
               "sampling": dict(temperature=0.0, max_tokens=200, logprobs=0, ignore_eos=True)}]
    pool = dict(num_gpu_blocks_override=24, max_model_len=512)
    tree_file = tmp_path / "tree.json"
    stock, custom = run_both(tmp_path, groups, pool, pool, env={
        "CHUNKATTN_TREE_STATS_FILE": str(tree_file), "CHUNKATTN_STATS_INTERVAL_S": "0",
        "CHUNKATTN_DEBUG_TREE": "1"})
    assert_same_outputs(stock, custom, atol=1e-3)
    assert_same_speculation(stock, custom)
    tree = json.loads(tree_file.read_text())
    assert tree["preemptions"] > 0, tree                    # the pool really was too small
    assert tree["invariant_checks"] >= tree["steps"] > 0
    assert tree["in_use_blocks"] == 0, tree                 # nothing leaked
