"""--pipeline-parallel-size 2 on CPU: CUSTOM is token-identical to stock PP=2 on the tiny fp32
model (2 layers: one a stage), both stages ran the native TPP kernel, decode read shared chunks,
and the sharing counters count each step once: not once per stage, nor per layer.

The oracle for "once": with every prompt prefilled whole (chunked prefill off) and greedy
ignore_eos outputs of M tokens, a request of P prompt tokens has M - 1 decode steps reading
P + 1, ..., P + M - 1 KV tokens; the engine's decode KV tokens are the sum of these over its
requests. Each stage is a worker process of its own and counts the step itself (its log lines);
the first stage alone writes /metrics and the stats file. As for TP, each rank's OpenMP threads
are bound by hand (VLLM_CPU_OMP_THREADS_BIND="0|1": one core a stage)."""
import json
import os
import re

import pytest

from test_vllm_equivalence import greedy_job, one_core_per_rank, parallel_prompts
from vllm_runs import (assert_native_kernel, assert_not_custom, assert_same_outputs,
                       decode_kv_tokens, prometheus_samples, run_llm)

pytestmark = pytest.mark.vllm
PP = 2
CORES = sorted(os.sched_getaffinity(0))
MAX_TOKENS = 12
# The worker's periodic line; with CHUNKATTN_STATS_INTERVAL_S=0 each stage logs it every step.
DECODE_LINE = re.compile(r"\(([^)]*?) pid=(\d+)\).*chunkattn decode: steps=(\d+) rows=(\d+) "
                         r"kv_tokens=(\d+) shared_kv_tokens=(\d+)")


def _pp_job(backend, prompts):
    # Not eager: vLLM 0.32's CPU worker builds a later stage's intermediate-tensor buffers
    # only in the compile warm-up, so PP with --enforce-eager fails on stock vLLM too.
    # Prompts prefilled whole (no chunked prefill), for the decode-token oracle.
    return greedy_job(backend, prompts, MAX_TOKENS, pipeline_parallel_size=PP,
                      enable_chunked_prefill=False, max_num_batched_tokens=2048,
                      enforce_eager=False)


def last_counts_per_stage(log: str) -> dict[str, tuple[int, ...]]:
    """Worker process -> (steps, rows, kv_tokens, shared_kv_tokens) of its last decode line."""
    last = {}
    for m in DECODE_LINE.finditer(log):
        last[m.group(2)] = tuple(int(g) for g in m.groups()[2:])
    return last


@pytest.mark.skipif(len(CORES) < PP, reason="one core per PP stage")
def test_pp2_custom_matches_stock_and_counts_each_step_once(tmp_path):
    prompts, env = parallel_prompts(), one_core_per_rank(PP)
    stats_file, tree_file = tmp_path / "stats.json", tmp_path / "tree.json"
    prom_dir = tmp_path / "prometheus"
    prom_dir.mkdir()
    stock = run_llm(_pp_job(None, prompts), tmp_path, env=env)
    custom = run_llm(_pp_job("CUSTOM", prompts), tmp_path,
                     env={**env, "CHUNKATTN_STATS_FILE": str(stats_file),
                          "CHUNKATTN_TREE_STATS_FILE": str(tree_file),
                          "CHUNKATTN_STATS_INTERVAL_S": "0",
                          "PROMETHEUS_MULTIPROC_DIR": str(prom_dir)})
    assert_not_custom(stock["log"])
    assert_native_kernel(custom["log"], ranks=PP)
    assert_same_outputs(stock, custom, atol=1e-3)
    assert all(len(c["token_ids"]) == MAX_TOKENS for g in custom["groups"] for o in g for c in o)

    expected = decode_kv_tokens(prompts["greedy"], MAX_TOKENS)
    stages = last_counts_per_stage(custom["log"])
    assert len(stages) == PP, stages                 # each stage counts the step itself
    for steps, rows, kv_tokens, shared in stages.values():
        assert rows == len(prompts["greedy"]) * (MAX_TOKENS - 1), stages
        assert kv_tokens == expected, (stages, expected)
    assert len(set(stages.values())) == 1, stages    # the same batches, counted the same

    stats = json.loads(stats_file.read_text())       # the first stage's: one count a step
    assert stats["kv_tokens"] == expected, (stats, expected)
    assert 0 < stats["shared_kv_tokens"] < stats["kv_tokens"], stats
    tree = json.loads(tree_file.read_text())         # the scheduler's own count
    assert tree["decode_kv_tokens"] == expected, (tree, expected)
    assert tree["decode_shared_kv_tokens"] == stats["shared_kv_tokens"], (tree, stats)
    assert tree["in_use_blocks"] == 0 and tree["num_live_seqs"] == 0, tree

    prom = prometheus_samples(prom_dir, "chunkattn:")
    assert prom["chunkattn:decode_kv_tokens_total"] == expected, prom
    assert prom["chunkattn:decode_shared_kv_tokens_total"] == stats["shared_kv_tokens"], prom
