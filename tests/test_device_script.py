"""benchmarks/gpu/sanitize.sh, the sanitizer step of run_on_device.sh, on stand-in sanitizers: a
machine whose runtime the tool refuses (gVisor H200s print "Device not supported") gives 75, no
verdict, which the device script reports as UNSUPPORTED instead of a failed kernel; an error the
tool found stays 99 and a crash keeps its own status."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SANITIZE = ROOT / "benchmarks" / "gpu" / "sanitize.sh"
DEVICE_SCRIPT = ROOT / "benchmarks" / "gpu" / "run_on_device.sh"

# What each stand-in prints, and its exit status (compute-sanitizer's messages and codes).
STAND_INS = {
    "refused": ("========= COMPUTE-SANITIZER\n========= Error: Device not supported\n"
                "========= Error: Target application returned an error\n", 255),
    "found_error": ("========= Invalid __global__ write of size 4 bytes\n"
                    "========= ERROR SUMMARY: 1 error\n", 99),
    "clean": ("========= ERROR SUMMARY: 0 errors\n", 0),
    "crashed": ("Traceback (most recent call last):\nRuntimeError: CUDA error\n", 1),
}


@pytest.mark.parametrize("case,want", [("refused", 75), ("found_error", 99), ("clean", 0),
                                       ("crashed", 1)])
def test_sanitize_exit_status(tmp_path, case, want):
    text, rc = STAND_INS[case]
    fake = tmp_path / "compute-sanitizer"
    args_file = tmp_path / "args"
    fake.write_text(f'#!/bin/sh\necho "$@" > {args_file}\nprintf \'%s\' "{text}"\nexit {rc}\n')
    fake.chmod(0o755)
    r = subprocess.run(["bash", str(SANITIZE), str(fake), "racecheck", "python3"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == want, r.stdout + r.stderr
    assert text.splitlines()[-1] in r.stdout                  # the tool's output is kept
    assert ("no verdict" in r.stdout) == (case == "refused")
    args = args_file.read_text().split()
    assert args[:2] == ["--tool", "racecheck"] and "kns=tpp_" in args
    assert args[-2:] == ["python3", str(SANITIZE.parent / "sanitize_tpp.py")]


def _fake_tool(path: Path, case: str) -> Path:
    text, rc = STAND_INS[case]
    path.write_text(f'#!/bin/sh\nprintf \'%s\' "{text}"\nexit {rc}\n')
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("case,want_rc,want_status", [
    ("refused", 0, "UNSUPPORTED here"), ("found_error", 1, "FAILED (rc 99)"), ("clean", 0, "ok")])
def test_device_script_sanitizer_stages(tmp_path, case, want_rc, want_status):
    """run_on_device.sh itself, sanitizer stages only, with a stand-in python (the build 'passes')
    and a stand-in compute-sanitizer on PATH: a refusal must not fail the call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_tool(bin_dir / "compute-sanitizer", case)
    fake_py = bin_dir / "python"
    fake_py.write_text("#!/bin/sh\nexit 0\n")
    fake_py.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "STAGES": "sanitizer",
           "PYTHON": str(fake_py), "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"),
           "CHUNKATTN_BUILD_DIR": str(tmp_path / "jit")}
    r = subprocess.run(["bash", str(DEVICE_SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert r.returncode == want_rc, summary
    for tool in ("memcheck", "racecheck"):
        line = next(x for x in summary.splitlines() if x.startswith(f"sanitizer-{tool}"))
        assert want_status in line, summary
    assert "build" in summary and "FAILED" not in summary.split("sanitizer-")[0]
