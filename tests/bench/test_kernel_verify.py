"""`python -m vllm_chunkattn.bench verify` at a small point: our kernel and vLLM's CPU_ATTN agree
on verify rows (checked inside the bench before timing) and the report lists every point."""
import csv
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


def test_verify_bench_small_grid(tmp_path):
    pytest.importorskip("vllm")
    proc = subprocess.run([sys.executable, "-m", "vllm_chunkattn.bench", "verify", "--n-p", "96",
                           "--b", "3", "--k", "0,3", "--block", "16", "--reps", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "kernel_cpu_verify_fp32.csv")))
    assert [(int(r["n_s"]), int(r["k"]), int(r["query_tokens"])) for r in rows] == [
        (0, 0, 3), (0, 3, 12), (96, 0, 3), (96, 3, 12)]
    assert all(float(r["ours_ms"]) > 0 and float(r["cpu_attn_ms"]) > 0 for r in rows)
    assert (tmp_path / "kernel_cpu_verify_fp32.png").exists()
