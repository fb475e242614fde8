"""vLLM's own tests as an external check: vLLM 0.32.0's tests/v1/core (prefix caching, scheduler,
KV cache utils, priority/preemption) and its attention-backend correctness harness, run against
the chunk prefix tree and CUSTOM by the pytest plugin tests/external/vllm_swap.py, in a
subprocess. The sources come from vLLM's sdist on the package registry
(tests/external/fetch_vllm_tests.sh, cached in .cache/vllm-src/), never from this repo. Every test
passes or is listed with its reason in tests/external/expected_failures.txt."""
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from vllm_sources import vllm_sources

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]
EXTERNAL = ROOT / "tests" / "external"
VERSION = "0.32.0"
SELECTION = [
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_priority_preemption_bug.py",
    "tests/v1/core/test_priority_scheduler_random.py",
    "tests/v1/attention/test_attention_backends.py::test_causal_backend_correctness",
    "tests/v1/attention/test_attention_backends.py::test_non_causal_backend_correctness",
]


def test_vllm_own_tests_pass_against_the_tree_and_custom(tmp_path, capsys):
    src = vllm_sources(VERSION)
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(EXTERNAL),
           "CHUNKATTN_EXT_REPORT": str(report), "CHUNKATTN_EXT_CHECK_STALE": "1"}
    # -c /dev/null and --rootdir: vLLM's tree, not this repo's pytest config; --confcutdir
    # keeps vLLM's root conftest (it needs vLLM's whole test environment) out.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "vllm_swap",
         "-c", os.devnull, "--rootdir", str(src), "--confcutdir", str(src / "tests" / "v1"),
         "-W", "ignore", "--tb=short", "-rfE", *SELECTION],
        cwd=src, env=env, capture_output=True, text=True, timeout=1200)
    assert report.exists(), proc.stdout[-5000:] + proc.stderr[-3000:]
    result = json.loads(report.read_text())
    tally = summarize(result)
    with capsys.disabled():
        print(f"\nvLLM {VERSION}'s own tests against the chunk tree / CUSTOM: {tally}")
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
