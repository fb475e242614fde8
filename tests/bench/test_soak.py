"""The CI-sized soak (`python -m vllm_chunkattn.bench soak --requests 150`): a CUSTOM server with a
KV pool of a few prompts, Poisson arrivals of tree-shaped prompts, n > 1 sampling, clients that
hang up mid-stream, over-long and malformed requests; then idle and whole, and every completed
greedy answer token-identical to stock vLLM's (fp32). The committed 1000-request run is
benchmarks/results/soak_cpu.md. Twice: as vLLM runs on CPU (V1 runner, no async scheduling), and
as it runs on a GPU (V2 runner, async scheduling on: tests/gpu_defaults_on_cpu/), both servers."""
import json
import os
import subprocess
import sys

import pytest

from vllm_runs import GPU_DEFAULTS, REPO, assert_native_kernel, tiny_model

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")


MODES = {"cpu": ({}, ("V1", "off")), "gpu-defaults": (GPU_DEFAULTS, ("V2", "on"))}


@pytest.fixture(scope="module", params=list(MODES))
def soak(request, tmp_path_factory):
    tiny_model()
    out = tmp_path_factory.mktemp("soak")
    env, modes = MODES[request.param]
    proc = subprocess.run([sys.executable, "-m", "vllm_chunkattn.bench", "soak", "--requests",
                           "150", "--out", str(out), "--log-dir", str(out / "logs"),
                           "--tag", "ci"], cwd=REPO, capture_output=True, text=True,
                          timeout=1500, env={**os.environ, **env})
    path = out / "soak_ci.json"
    assert path.exists(), f"no soak result (rc={proc.returncode}):\n{proc.stdout[-3000:]}" \
                          f"\n{proc.stderr[-3000:]}"
    result = json.loads(path.read_text())
    result["rc"] = proc.returncode
    assert (result["model_runner"], result["async_scheduling"]) == modes, result
    result["custom_log"] = (out / "logs" / "soak_custom.server.log").read_text()
    return result


def test_soak_served_every_request_as_expected(soak):
    assert_native_kernel(soak["custom_log"])
    assert soak["num_failed"] == 0, soak["failed"]
    kinds = soak["by_kind"]
    # The mix really had every fault in it, and each was answered the way it must be.
    for kind in ("greedy", "greedy-stream", "sampled-n", "disconnect", "overlong"):
        assert kinds[kind]["sent"] >= 3 and kinds[kind].get("ok") == kinds[kind]["sent"], kinds
    bad = ("bad-json", "negative-max-tokens", "unknown-model", "empty-prompt")
    assert all(kinds[k]["sent"] >= 1 for k in bad), kinds
    for kind in ("overlong", *bad):
        codes = [int(c[5:]) for c in kinds[kind] if c.startswith("http_")]
        assert codes and all(400 <= c < 500 for c in codes), (kind, kinds[kind])
    assert kinds["unknown-model"].get("http_404") == kinds["unknown-model"]["sent"], kinds


def test_soak_left_the_engine_alive_and_the_pool_empty(soak):
    assert soak["alive"] and soak["idle"] and soak["probe_tokens"] == 2
    assert soak["kv_usage_after"] == 0
    assert soak["chunks_in_use_after"] == 0 and soak["live_seqs_at_probe"] == 1
    # The invariant checker ran at every step, the last one after every request had ended.
    assert soak["steps"] > 100 and soak["invariant_checks"] == soak["steps"]
    # The pool was small enough for the faults the soak is for.
    assert soak["preemptions"] > 0 and soak["evictions"] > 0, soak


def test_soak_greedy_answers_match_stock(soak):
    assert soak["greedy_compared"] >= 40 and soak["greedy_tokens_compared"] > 500
    assert soak["mismatches"] == []
    assert soak["rc"] == 0 and soak["failures"] == []
