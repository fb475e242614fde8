"""Helpers to run the tiny model through vLLM's LLM in a child process (vLLM on CPU spawns its
workers; a child keeps each engine's lifetime and memory out of the pytest process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_chunkattn.bench.server_process import KERNEL_IN_USE

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "models" / "tiny-llama"
# vLLM on CPU as it runs on a GPU: the V2 model runner and async scheduling kept on (Triton's
# interpreter runs V2's kernels: tests/gpu_defaults_on_cpu/sitecustomize.py). Merged into a child's
# environment; test_v2_model_runner.py says what it covers.
def cpu_writes_fp8() -> bool:
    """vLLM's CPU backend writes fp8 KV caches only on CPUs with AVX-512 or AMX."""
    import torch
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


# fp8 KV cache tests on a CPU where stock vLLM itself cannot run them (CUSTOM refuses there).
NEEDS_CPU_FP8 = pytest.mark.skipif(
    not cpu_writes_fp8(), reason="vLLM's CPU backend writes fp8 KV caches only with AVX-512 or AMX")

GPU_DEFAULTS = {"VLLM_USE_V2_MODEL_RUNNER": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [
                    str(REPO / "tests" / "gpu_defaults_on_cpu"), os.environ.get("PYTHONPATH")]))}


def tiny_model() -> Path:
    from vllm_chunkattn.tiny_model import ensure_tiny_model
    return ensure_tiny_model(MODEL_DIR)


# The engine core in the job's own process: each vLLM process imports vLLM and torch first, ~15 s
# on a 2-core runner. What these jobs check (tokens, logprobs, the tree's invariants, the
# builder's host copies) is the same either way, and the servers' tests (test_server, test_soak,
# test_serve_ab_script, test_demo) run vLLM's process layout as users do.
IN_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def job_env(extra: dict | None = None) -> dict:
    """A vLLM test job's environment: offline, the engine core in-process, then `extra`."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", **IN_PROCESS_ENGINE, **(extra or {})}


def run_llm(job: dict, tmp_path: Path, timeout: int = 900, env: dict | None = None) -> dict:
    """Run tests/llm_job.py with `job` (engine kwargs + requests); returns its JSON result."""
    pytest.importorskip("vllm")
    job_file = tmp_path / f"job_{os.getpid()}_{len(list(tmp_path.iterdir()))}.json"
    out_file = job_file.with_suffix(".out.json")
    job_file.write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "llm_job.py"), str(job_file),
                           str(out_file)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=job_env(env))
    if proc.returncode != 0 or not out_file.exists():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"LLM job failed (rc={proc.returncode}):\n{tail}")
    result = json.loads(out_file.read_text())
    result["log"] = proc.stdout + proc.stderr
    return result


def assert_native_kernel(log, device: str = "cpu", ranks: int | None = None) -> None:
    """CUSTOM served, and with the native kernel on every rank: a silent fallback to the
    PyTorch reference (or to vLLM's backend) fails. `log`: text or lines of the run's output;
    `ranks`: how many processes must have announced it (one per TP rank)."""
    text = log if isinstance(log, str) else "\n".join(log)
    kernels = KERNEL_IN_USE.findall(text)
    assert kernels, "no 'ChunkAttention backend (CUSTOM) in use' line: CUSTOM did not run"
    assert set(kernels) == {f"native-{device}"}, f"TPP decode kernels in use: {kernels}"
    assert ranks is None or len(kernels) == ranks, f"{len(kernels)} ranks ran CUSTOM, not {ranks}"


def assert_not_custom(log: str) -> None:
    """The stock side of an A/B really ran vLLM's own backend."""
    assert not KERNEL_IN_USE.search(log), "the stock run used CUSTOM"


def assert_same_outputs(stock, custom, atol=1e-4):
    """Two run_llm results: the same token ids, logprobs within atol, request by request."""
    assert len(stock["groups"]) == len(custom["groups"])
    for g_stock, g_custom in zip(stock["groups"], custom["groups"]):
        assert len(g_stock) == len(g_custom)
        for i, (a, b) in enumerate(zip(g_stock, g_custom)):
            assert len(a) == len(b)
            for ca, cb in zip(a, b):
                assert ca["token_ids"] == cb["token_ids"], f"request {i}: tokens differ"
                diff = max(abs(x - y) for x, y in zip(ca["logprobs"], cb["logprobs"]))
                assert diff <= atol, f"request {i}: logprob differs by {diff}"


def decode_kv_tokens(prompts, max_tokens: int) -> int:
    """The oracle for the decode KV tokens of greedy ignore_eos requests prefilled whole: a
    prompt of P tokens and M outputs has M - 1 decode steps reading P + 1, ..., P + M - 1."""
    m = max_tokens
    return sum((m - 1) * len(p) + m * (m - 1) // 2 for p in prompts)


def prometheus_samples(path, prefix: str = "") -> dict[str, float]:
    """Sample name -> value from a PROMETHEUS_MULTIPROC_DIR (what a /metrics would read)."""
    from prometheus_client import CollectorRegistry, multiprocess
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(path))
    return {s.name: s.value for m in registry.collect() for s in m.samples
            if s.name.startswith(prefix)}
