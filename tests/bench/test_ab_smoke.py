"""`python -m vllm_chunkattn.bench ab --smoke`: both servers answer and the report is written."""
import csv
import subprocess
import sys

import pytest

from vllm_runs import assert_native_kernel, assert_not_custom

pytestmark = pytest.mark.vllm


def test_ab_smoke(tmp_path):
    pytest.importorskip("vllm")
    out, logs = tmp_path / "results", tmp_path / "logs"
    proc = subprocess.run([sys.executable, "-m", "vllm_chunkattn.bench", "ab", "--smoke",
                           "--out", str(out), "--log-dir", str(logs)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert_native_kernel((logs / "custom.server.log").read_text())
    assert_not_custom((logs / "stock.server.log").read_text())
    rows = list(csv.DictReader(open(out / "ab_smoke.csv")))
    for system in ("stock", "custom"):
        mine = [r for r in rows if r["system"] == system]
        assert mine, f"no rows for {system}"
        assert all(r["status"] == "ok" for r in mine), mine
        assert all(float(r["output_tok_s"]) > 0 for r in mine), mine
        assert all(int(r["completed"]) == int(r["num_prompts"]) for r in mine), mine
    md = (out / "ab_smoke.md").read_text()
    assert "| shared0 |" in md and "stock tok/s" in md and "custom tok/s" in md
