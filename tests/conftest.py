import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # tests/ helpers (vllm_runs)

import pytest  # noqa: E402

# On pytest-xdist workers (CI: -n 2), each worker's vLLM engines compute on a core of their own
# (vLLM's auto binding puts every engine's OpenMP threads on the same core). A test that binds by
# hand (test_tensor_parallel) still does.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    _cores = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(_cores[int(_worker[2:]) % len(_cores)])


@pytest.fixture
def splits(monkeypatch):
    """Force the CUDA op's KV splits (its host code reads CHUNKATTN_{CHUNK,SEQ}_SPLITS on every
    call): test_ops_cuda.py on a GPU, test_cuda_simt_emulation.py on CPU."""
    def set_(chunk: int, seq: int):
        monkeypatch.setenv("CHUNKATTN_CHUNK_SPLITS", str(chunk))
        monkeypatch.setenv("CHUNKATTN_SEQ_SPLITS", str(seq))
    return set_


# benchmarks/gpu/kernel_mutations.py points this at a mutated copy of csrc/.
SIMT_CSRC = Path(os.environ.get("CHUNKATTN_SIMT_CSRC")
                 or Path(__file__).resolve().parents[1] / "csrc")


@pytest.fixture(scope="session")
def emu():
    """torch.ops.chunkattn_simt: the CUDA kernel's source and the CUDA op's host code built for
    the CPU with the SIMT emulation (csrc/cuda_emu), from SIMT_CSRC."""
    import torch

    from vllm_chunkattn.ops.jit_build import load_simt_emulation
    load_simt_emulation(SIMT_CSRC)
    return torch.ops.chunkattn_simt


@pytest.fixture(autouse=True)
def _cuda_errors_stay_with_their_test(request):
    """A GPU test ends with a device sync, so an asynchronous CUDA error (an illegal address in a
    kernel it launched) fails that test's teardown, not the next test's first allocation
    (without it, every later test fails at torch.zeros in make_batch for that one kernel)."""
    yield
    if request.node.get_closest_marker("gpu") is None:
        return
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
