"""`python -m vllm_chunkattn.bench offline` on the tiny model: both engines generate, the report
is written, and in fp32 CUSTOM's greedy tokens equal stock's."""
import csv
import re
import subprocess
import sys

import pytest

from vllm_runs import assert_native_kernel, assert_not_custom

pytestmark = pytest.mark.vllm


def test_offline_bench_tiny(tmp_path):
    pytest.importorskip("vllm")
    out, logs = tmp_path / "results", tmp_path / "logs"
    proc = subprocess.run([sys.executable, "-m", "vllm_chunkattn.bench", "offline", "--batch", "4",
                           "--max-tokens", "8", "--shared", "0,128", "--repeats", "1",
                           "--dtype", "float32", "--out", str(out), "--tag", "test",
                           "--log-dir", str(logs)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert_native_kernel((logs / "custom.log").read_text())     # each engine's own log
    assert_not_custom((logs / "stock.log").read_text())
    for ext in ("csv", "md", "png"):
        assert (out / f"offline_test.{ext}").exists()
    rows = list(csv.DictReader(open(out / "offline_test.csv")))
    assert {(r["workload"], r["system"]) for r in rows} == {
        (w, s) for w in ("shared0", "shared128") for s in ("stock", "custom")}
    for r in rows:
        assert float(r["median_tok_s"]) > 0, r
        assert int(r["mismatched_requests"]) == 0, r
        # fp32: the systems' logprobs agree to rounding; no divergence, so no tie gap.
        assert 0 <= float(r["max_logprob_diff"]) < 1e-3, r
        assert r["max_tie_gap"] == "nan", r
        # The warm-up cached every prompt: a timed call recomputes only the last token.
        assert float(r["cached_prompt_pct"]) > 99, r
        assert (r["draft_tokens"], r["accepted_tokens"]) == ("0", "0"), r   # no speculation
    md = (out / "offline_test.md").read_text()
    assert md.count("Command: `python -m vllm_chunkattn.bench offline") == 1
    assert "Share of the shared-prefix attention cost removed at S = 128" in md
    # Both engines started before either was ready (at once: one start's wait, on a GPU the
    # longer for torch.compile and graph capture).
    starts = {s: (float(t0), float(ready)) for s, t0, ready in re.findall(
        r"(stock|custom) started at ([\d.]+), ready at ([\d.]+)", md)}
    assert starts.keys() == {"stock", "custom"}, md
    assert max(t0 for t0, _ in starts.values()) < min(ready for _, ready in starts.values()), md


def test_offline_bench_counts_drafts_with_speculative_decoding(tmp_path):
    """With n-gram drafts on both engines the report has vLLM's draft and acceptance counts of
    the timed calls: the same in both systems (greedy, the same tokens), some drafts rejected."""
    pytest.importorskip("vllm")
    out = tmp_path / "results"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, ' \
           '"prompt_lookup_min": 2}'
    proc = subprocess.run([sys.executable, "-m", "vllm_chunkattn.bench", "offline", "--batch", "4",
                           "--max-tokens", "32", "--shared", "64", "--repeats", "1",
                           "--dtype", "float32", "--block-size", "32", "--out", str(out),
                           "--tag", "spec", "--speculative-config", spec],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["system"]: r for r in csv.DictReader(open(out / "offline_spec.csv"))}
    counts = {s: (int(r["draft_tokens"]), int(r["accepted_tokens"])) for s, r in rows.items()}
    assert counts["stock"] == counts["custom"], counts
    drafted, accepted = counts["stock"]
    assert 0 < accepted < drafted, counts
    assert int(rows["custom"]["mismatched_requests"]) == 0
    md = (out / "offline_spec.md").read_text()
    assert f"shared64: stock {drafted} / {accepted}, custom {drafted} / {accepted}" in md, md
