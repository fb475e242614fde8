import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # tests/ helpers (vllm_runs)

import pytest  # noqa: E402


@pytest.fixture
def splits(monkeypatch):
    """Force the CUDA op's KV splits (its host code reads CHUNKATTN_{CHUNK,SEQ}_SPLITS on every
    call): test_ops_cuda.py on a GPU, test_cuda_simt_emulation.py on CPU."""
    def set_(chunk: int, seq: int):
        monkeypatch.setenv("CHUNKATTN_CHUNK_SPLITS", str(chunk))
        monkeypatch.setenv("CHUNKATTN_SEQ_SPLITS", str(seq))
    return set_
