"""benchmarks/gpu/take_results.py: a GPU run's results land under the GPU's name, the earlier
run's files are kept under their commit, and the two grids are set side by side with FlashInfer's
own change as the yardstick. The earlier run is the H100's committed grid."""
from __future__ import annotations

import csv
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "benchmarks" / "gpu" / "take_results.py"
POINT = ("paper", "n_p=4096 n_s=4096")
NEW = "abc1234"


def _module():
    spec = importlib.util.spec_from_file_location("take_results", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _new_grid_csv() -> tuple[str, dict]:
    """The committed grid with FlashInfer decode 1.1x slower everywhere and ours halved at POINT."""
    with (RESULTS / "kernel_cuda_gpu_h100.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    old_point = next(dict(r) for r in rows if (r["grid"], r["point"]) == POINT)
    for r in rows:
        r["fi_decode_us"] = repr(float(r["fi_decode_us"]) * 1.1)
        if (r["grid"], r["point"]) == POINT:
            r["ours_us"] = repr(float(r["ours_us"]) / 2)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue(), old_point


def _run_out(tmp: Path, grid_csv: str) -> Path:
    run_out = tmp / "run_out"
    run_out.mkdir()
    (run_out / "summary.md").write_text(f"== summary (2026-11-28T00:00:00Z, {NEW})\ntests  ok\n")
    members = {
        "bench/kernel_cuda_gpu.md": f"# TPP decode\nDevice: NVIDIA H100; commit {NEW}; wall 19 s\n",
        "bench/kernel_cuda_gpu.csv": grid_csv,
        "bench/tpot_cuda.md": f"# tpot\ncommit {NEW}\n",
        "ncu.md": "| point | kernel |\n",
        "microbench_float16.json": json.dumps({"results": [{"shape": "a", "tpp_us": 1.0}]}),
        "microbench_bfloat16.json": json.dumps({"results": [{"shape": "a", "tpp_us": 2.0}]}),
    }
    with tarfile.open(run_out / "results.tar.gz", "w:gz") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return run_out


OLD = "2e01a0f"


def _results_dir(tmp: Path) -> Path:
    """The results folder before the run: the committed H100 grid and microbench, and .md files
    whose provenance names commit OLD (a later H100 run may replace the committed ones)."""
    out = tmp / "results"
    out.mkdir()
    for name in ("kernel_cuda_gpu_h100.csv", "tpp_microbench_h100.json"):
        shutil.copyfile(RESULTS / name, out / name)
    for name in ("kernel_cuda_gpu_h100.md", "tpot_cuda_h100.md", "ncu_h100.md"):
        (out / name).write_text(f"# {name}\nDevice: NVIDIA H100; commit {OLD}; wall 19 s\n")
    return out


def test_a_call_lands_under_the_gpu_name_and_keeps_the_earlier_run(tmp_path):
    grid_csv, old_point = _new_grid_csv()
    run_out, out = _run_out(tmp_path, grid_csv), _results_dir(tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    done = subprocess.run([sys.executable, str(SCRIPT), str(run_out), "--gpu", "h100", "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (out / "kernel_cuda_gpu_h100.csv").read_bytes() == grid_csv.encode()
    assert NEW in (out / "kernel_cuda_gpu_h100.md").read_text()
    # the earlier run's files, under the commit their own provenance names
    for name in ("kernel_cuda_gpu_h100.md", "kernel_cuda_gpu_h100.csv", "tpot_cuda_h100.md",
                 "ncu_h100.md", "tpp_microbench_h100.json"):
        kept = out / name.replace("_h100", f"_h100_{OLD}")
        assert kept.read_bytes() == before[name], kept.name
    micro = json.loads((out / "tpp_microbench_h100.json").read_text())
    assert micro == {"bfloat16": {"results": [{"shape": "a", "tpp_us": 2.0}]},
                     "float16": {"results": [{"shape": "a", "tpp_us": 1.0}]}}
    assert (out / "ncu_h100.md").read_text() == "| point | kernel |\n"

    runs = (out / "kernel_cuda_gpu_h100_runs.md").read_text()
    assert f"run {NEW} against run {OLD}" in runs
    row = next(line for line in runs.splitlines() if line.startswith(f"| {POINT[0]} | {POINT[1]} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    old_ours, old_fi = float(old_point["ours_us"]), float(old_point["fi_decode_us"])
    assert cells[2:8] == [f"{old_ours:.1f}", f"{old_ours / 2:.1f}", "0.500",
                          f"{old_fi:.1f}", f"{old_fi * 1.1:.1f}", "1.100"]
    assert "FlashInfer decode 1.100." in runs          # the yardstick: every point 1.1x


def test_a_second_import_of_the_same_call_changes_nothing(tmp_path):
    grid_csv, _ = _new_grid_csv()
    run_out, out = _run_out(tmp_path, grid_csv), _results_dir(tmp_path)
    mod = _module()
    mod.take(run_out, "h100", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = mod.take(run_out, "h100", out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not any(line.startswith("kept:") for line in again)


def test_a_folder_without_the_tarball_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="results.tar.gz"):
        _module().take(tmp_path, "h100", tmp_path)
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--gpu", "H100!"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "short lower-case name" in done.stderr


def test_an_earlier_run_is_kept_under_the_tree_it_ran_and_never_over_a_kept_file(tmp_path):
    """The H200's grid of 3fbe78e says `commit 81f9c98+changes (the tree of 3fbe78e)`, with a grid
    of 81f9c98 kept beside it: as the results folder stood once an import had overwritten that
    grid. The earlier run goes to _3fbe78e, _81f9c98 stays as it was;
    a kept name taken by other bytes gets _2 rather than losing either file."""
    grid_csv, _ = _new_grid_csv()
    run_out, out = _run_out(tmp_path, grid_csv), tmp_path / "results"
    out.mkdir()
    committed = {"kernel_cuda_gpu_h200.md": "kernel_cuda_gpu_h200_3fbe78e.md",
                 "kernel_cuda_gpu_h200.csv": "kernel_cuda_gpu_h200_3fbe78e.csv",
                 "kernel_cuda_gpu_h200_81f9c98.md": "kernel_cuda_gpu_h200_81f9c98.md",
                 "tpot_cuda_h200.md": "tpot_cuda_h200_3fbe78e.md"}
    for name, source in committed.items():
        shutil.copyfile(RESULTS / source, out / name)
    (out / "tpot_cuda_h200_3fbe78e.md").write_text("another run of that tree\n")
    done = _module().take(run_out, "h200", out)
    assert "kept: kernel_cuda_gpu_h200.md -> kernel_cuda_gpu_h200_3fbe78e.md" in done
    for kept, name in (("kernel_cuda_gpu_h200_3fbe78e.md", "kernel_cuda_gpu_h200.md"),
                       ("kernel_cuda_gpu_h200_3fbe78e.csv", "kernel_cuda_gpu_h200.csv"),
                       ("kernel_cuda_gpu_h200_81f9c98.md", "kernel_cuda_gpu_h200_81f9c98.md"),
                       ("tpot_cuda_h200_3fbe78e_2.md", "tpot_cuda_h200.md")):
        committed_bytes = (RESULTS / committed[name]).read_bytes()
        assert (out / kept).read_bytes() == committed_bytes, kept
    assert (out / "tpot_cuda_h200_3fbe78e.md").read_text() == "another run of that tree\n"
    assert "run abc1234 against run 3fbe78e" in (out / "kernel_cuda_gpu_h200_runs.md").read_text()
