"""benchmarks/gpu/sanitize.sh, the sanitizer step of run_on_device.sh, on stand-in sanitizers: a
machine whose runtime the tool refuses (gVisor H200s print "Device not supported") gives 75, no
verdict, which the device script reports as UNSUPPORTED instead of a failed kernel; an error the
tool found stays 99 and a crash keeps its own status."""
from __future__ import annotations

import os
import re
import subprocess
import threading
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
           "CHUNKATTN_BUILD_DIR": str(tmp_path / "jit"), "FI_WHEELS": str(tmp_path / "none"),
           "WARM_STATE": str(tmp_path / "warm")}
    r = subprocess.run(["bash", str(DEVICE_SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert r.returncode == want_rc, summary
    for tool in ("memcheck", "racecheck"):
        line = next(x for x in summary.splitlines() if x.startswith(f"sanitizer-{tool}"))
        assert want_status in line, summary
    assert "build" in summary and "FAILED" not in summary.split("sanitizer-")[0]


def test_flashinfer_warm_outlives_its_call_and_the_bench_call_waits_for_it(tmp_path):
    """STAGES=flashinfer-warm starts FlashInfer's JIT build detached and returns while it runs;
    the later STAGES=bench call neither reinstalls the wheels under it nor times anything before
    it ends (a stand-in python whose warm-up blocks until released)."""
    record, release = tmp_path / "record", tmp_path / "release"
    fake_py = tmp_path / "python"
    fake_py.write_text(f"""#!/bin/sh
case "$*" in
  *"--warm "*) echo "warm-start $4" >> {record}
               while [ ! -f {release} ]; do sleep 0.1; done
               echo "warm-end $4" >> {record} ;;
  *"pip install"*) echo pip >> {record} ;;
  *"bench kernel"*) echo bench >> {record} ;;
esac
exit 0
""")
    fake_py.chmod(0o755)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "flashinfer_python-0.6.14-py3-none-any.whl").write_bytes(b"stand-in")
    site = tmp_path / "site"
    site.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(fake_py),
           "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"),
           "CHUNKATTN_BUILD_DIR": str(tmp_path / "jit"), "FI_WHEELS": str(wheels),
           "FI_SITE": str(site), "WARM_STATE": str(tmp_path / "warm"), "BUDGET_S": "120"}

    first = subprocess.run(["bash", str(DEVICE_SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                           env={**env, "STAGES": "flashinfer-warm"}, timeout=120)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert first.returncode == 0, summary
    assert "flashinfer-warm        started detached" in summary
    pid = int((tmp_path / "warm.pid").read_text())
    os.kill(pid, 0)                                      # still building after its call returned
    assert "warm-end" not in record.read_text()

    threading.Timer(1.5, release.touch).start()
    second = subprocess.run(["bash", str(DEVICE_SCRIPT)], cwd=ROOT, capture_output=True,
                            text=True, env={**env, "STAGES": "bench"}, timeout=120)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert second.returncode == 0, summary
    assert re.search(r"flashinfer-wait +ok", summary) and re.search(r"flashinfer-jit +ok", summary)
    assert "flashinfer             ok (installed by an earlier call)" in summary
    lines = record.read_text().split()
    assert lines.count("pip") == 1                       # installed by the first call only
    detached_ends = max(i for i, x in enumerate(lines) if x == "warm-end")
    assert lines.index("bench") > detached_ends
    assert lines[:lines.index("bench")].count("warm-start") == 4     # detached, then cached
