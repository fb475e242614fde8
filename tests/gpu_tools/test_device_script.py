"""benchmarks/gpu/sanitize.sh, the sanitizer step of run_on_device.sh, on stand-in sanitizers: a
machine whose runtime the tool refuses (gVisor H200s print "Device not supported") gives 75, no
verdict, which the device script reports as UNSUPPORTED instead of a failed kernel; an error the
tool found stays 99 and a crash keeps its own status."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def _run_with_stand_ins(tmp_path, bin_dir, stages: str, python_body: str):
    """run_on_device.sh with STAGES=stages, bin_dir's stand-in tools first on PATH and a
    stand-in python running python_body (its build 'passes'). (result, summary.md)"""
    fake_py = bin_dir / "python"
    fake_py.write_text(f"#!/bin/sh\n{python_body}\n")
    fake_py.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "STAGES": stages,
           "PYTHON": str(fake_py), "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"),
           "CHUNKATTN_BUILD_DIR": str(tmp_path / "jit"), "FI_WHEELS": str(tmp_path / "none"),
           "WARM_STATE": str(tmp_path / "warm")}
    r = subprocess.run(["bash", str(DEVICE_SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    return r, (tmp_path / "out" / "summary.md").read_text()


@pytest.mark.parametrize("case,want_rc,want_status", [
    ("refused", 0, "UNSUPPORTED here"), ("found_error", 1, "FAILED (rc 99)"), ("clean", 0, "ok")])
def test_device_script_sanitizer_stages(tmp_path, case, want_rc, want_status):
    """run_on_device.sh itself, sanitizer stages only, with a stand-in python (the build 'passes')
    and a stand-in compute-sanitizer on PATH: a refusal must not fail the run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_tool(bin_dir / "compute-sanitizer", case)
    r, summary = _run_with_stand_ins(tmp_path, bin_dir, "sanitizer", "exit 0")
    assert r.returncode == want_rc, summary
    for tool in ("memcheck", "racecheck"):
        line = next(x for x in summary.splitlines() if x.startswith(f"sanitizer-{tool}"))
        assert want_status in line, summary
    assert "build" in summary and "FAILED" not in summary.split("sanitizer-")[0]


def test_flashinfer_warm_outlives_its_run_and_the_bench_run_waits_for_it(tmp_path):
    """STAGES=flashinfer-warm starts FlashInfer's JIT build detached and returns while it runs;
    the later STAGES=bench run neither reinstalls the wheels under it nor times anything before
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
  *"flashinfer_aot.py install"*) echo "aot $*" | tr ' ' '|' >> {record}
                                 echo "5 of 5 modules ready (stand-in)" ;;
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
           "FI_SITE": str(site), "WARM_STATE": str(tmp_path / "warm"), "TIME_LIMIT_S": "120"}

    first = subprocess.run(["bash", str(DEVICE_SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                           env={**env, "STAGES": "flashinfer-warm"}, timeout=120)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert first.returncode == 0, summary
    assert "flashinfer-warm        started detached" in summary
    # The modules compiled ahead of time are in place before the warm-up would build them.
    assert "flashinfer-aot         5 of 5 modules ready (stand-in)" in summary
    _until(lambda: "warm-start" in record.read_text())   # the detached, niced build's start
    steps = record.read_text().split()
    aot = next(x for x in steps if x.startswith("aot|"))
    assert f"--site|{site}|--tar|{wheels}/flashinfer_aot_sm90a.tar.xz|" in aot
    assert steps.index(aot) < steps.index("warm-start")
    pid = int((tmp_path / "warm.pid").read_text())
    os.kill(pid, 0)                                      # still building after its run returned
    assert "warm-end" not in record.read_text()

    threading.Timer(1.5, release.touch).start()
    second = subprocess.run(["bash", str(DEVICE_SCRIPT)], cwd=ROOT, capture_output=True,
                            text=True, env={**env, "STAGES": "bench"}, timeout=120)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert second.returncode == 0, summary
    assert re.search(r"flashinfer-wait +ok", summary) and re.search(r"flashinfer-jit +ok", summary)
    assert "flashinfer             ok (installed by an earlier run)" in summary
    lines = [x for x in record.read_text().split() if not x.startswith("aot|")]
    assert lines.count("pip") == 1                       # installed by the first run only
    detached_ends = max(i for i, x in enumerate(lines) if x == "warm-end")
    assert lines.index("bench") > detached_ends
    assert lines[:lines.index("bench")].count("warm-start") == 4     # detached, then cached


DETACHED = ROOT / "benchmarks" / "gpu" / "detached_bench.sh"
INSTALL = ROOT / "benchmarks" / "gpu" / "offline" / "install_bundle.sh"


def _detached_env(tmp_path: Path, fake_py: Path, **extra) -> dict:
    return {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(fake_py),
            "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"),
            "CHUNKATTN_BUILD_DIR": str(tmp_path / "jit"), "FI_WHEELS": str(tmp_path / "none"),
            "FI_SITE": str(tmp_path / "site"), "WARM_STATE": str(tmp_path / "warm"),
            "BENCH_STATE": str(tmp_path / "bench"), "VLLM_MARKER": str(tmp_path / "marker"),
            "VLLM_SITE": str(tmp_path / "vllm_site"), **extra}


def _end_session(sid: int) -> None:
    subprocess.run(["pkill", "-KILL", "-s", str(sid)], capture_output=True)


def _until(cond, seconds=20.0):
    import time
    t = time.time()
    while not cond():
        assert time.time() - t < seconds, "timed out"
        time.sleep(0.1)


def test_detached_bench_runs_beside_the_bundle_collects_and_gates_the_gpu(tmp_path):
    """STAGES=bench-detach: the script returns while the benchmarks run on (from a snapshot of
    the tree, in a POSIX session of their own); the bundle's collects report its progress; the
    GPU tests under vLLM start only once it has ended; `collect` brings its files back with what
    ran beside it."""
    record, release = tmp_path / "record", tmp_path / "release"
    fake_py = tmp_path / "python"
    fake_py.write_text(f"""#!/bin/sh
case "$*" in
  *"bench kernel"*) echo "bench-start $PWD" >> {record}
                    while [ ! -f {release} ]; do sleep 0.1; done
                    echo bench-end >> {record} ;;
  *"-m pytest"*) echo pytest >> {record} ;;
esac
exit 0
""")
    fake_py.chmod(0o755)
    env = _detached_env(tmp_path, fake_py)
    first = subprocess.run(["bash", str(DEVICE_SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                           env={**env, "STAGES": "bench-detach"}, timeout=120)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert first.returncode == 0, summary
    assert re.search(r"bench-detach +started \(pid \d+, TIME_LIMIT_S 480", summary), summary
    pid = int((tmp_path / "bench" / "pid").read_text())
    try:
        _until(lambda: record.exists() and "bench-start" in record.read_text())
        assert f"bench-start {tmp_path / 'bench' / 'src'}" in record.read_text()   # the snapshot
        assert os.getsid(pid) == pid                # its own POSIX session: outlives the script

        (tmp_path / "marker").write_text("t c02\nt c03\nt c04\n")             # three collects
        status = subprocess.run(["bash", str(DETACHED), "status"], env=env, capture_output=True,
                                text=True, timeout=30).stdout
        assert "detached bench: running" in status and "bench-trees" in status, status

        threading.Timer(2.0, release.touch).start()
        subprocess.run(["bash", str(INSTALL), "gputests"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
        lines = record.read_text().split("\n")
        assert "pytest" in lines and lines.index("bench-end") < lines.index("pytest"), lines

        collected = subprocess.run(["bash", str(DETACHED), "collect"], env={
            **env, "OUT": str(tmp_path / "back")}, capture_output=True, text=True, timeout=120)
        back = tmp_path / "back"
        text = (back / "summary.md").read_text()
        assert "beside it: 3 collects" in text and "rc 0" in text, collected.stdout
        assert re.search(r"bench-trees +ok", text), text
        assert (back / "detached_bench.log").exists() and (back / "results.tar.gz").exists()
        assert len(list(back.iterdir())) <= 8                 # $OUT's at most 8 files
    finally:
        release.touch()
        _end_session(pid)


def test_a_hung_detached_bench_is_ended_when_its_time_limit_is_spent(tmp_path):
    """`wait` gives a detached bench its time limit and the grace, then ends its whole POSIX
    session, so a hang cannot hold the GPU from the install and the servers."""
    fake_py = tmp_path / "python"
    fake_py.write_text("#!/bin/sh\ntrap '' TERM\nwhile :; do sleep 0.2; done\n")   # hangs in 'env'
    fake_py.chmod(0o755)
    env = _detached_env(tmp_path, fake_py, BENCH_TIME_LIMIT_S="16", BENCH_GRACE_S="0")
    started = subprocess.run(["bash", str(DETACHED), "start"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    assert "started" in started.stdout, started.stdout + started.stderr
    pid = int((tmp_path / "bench" / "pid").read_text())
    try:
        waited = subprocess.run(["bash", str(DETACHED), "wait"], env=env, capture_output=True,
                                text=True, timeout=60)
        assert "ended (its session killed)" in waited.stdout, waited.stdout
        _until(lambda: subprocess.run(["pgrep", "-s", str(pid)], capture_output=True).returncode)
        assert (tmp_path / "bench" / "rc").read_text().strip() == "137"
    finally:
        _end_session(pid)


GPU_DIR = ROOT / "benchmarks" / "gpu"
READMES = [GPU_DIR / "README.md", GPU_DIR / "offline" / "README.md", GPU_DIR / "rehearsal.md"]


def test_the_readmes_name_only_what_the_scripts_do():
    """What benchmarks/gpu's READMEs tell a user to run exists: every `bash benchmarks/gpu/X.sh
    SUB` they name takes SUB, and every STAGES word they set is one run_on_device.sh acts on."""
    text = "\n".join(p.read_text() for p in READMES)
    calls = set(re.findall(r"bash (benchmarks/gpu/(?:offline/)?[a-z_]+\.sh)(?: ([a-z]+))?", text))
    assert ("benchmarks/gpu/detached_bench.sh", "collect") in calls
    assert ("benchmarks/gpu/offline/install_bundle.sh", "install") in calls
    for script, sub in calls:
        body = (ROOT / script).read_text()
        if sub and script.endswith(("install_bundle.sh", "detached_bench.sh")):
            assert re.search(rf"^  {sub}\)", body, re.M), f"{script} has no '{sub}'"
        elif sub:                                      # serve_ab.sh: the system, or both
            assert sub in ("stock", "custom", "pair"), (script, sub)
            cases = re.findall(r"^  ([\w|]+)\)", body, re.M)          # its `case $MODE in`
            assert any(sub in c.split("|") for c in cases), f"{script} has no '{sub}'"
    acted_on = set(re.findall(r"\bwant ([a-z-]+)", DEVICE_SCRIPT.read_text()))
    stages = {w for quoted, bare in re.findall(r'STAGES=(?:"([a-z -]+)"|([a-z-]+))', text)
              for w in (quoted or bare).split()}
    assert {"tests", "sanitizer", "bench", "bench-detach"} <= stages
    assert stages <= acted_on, stages - acted_on


def test_the_readmes_steps_are_the_scripts_steps():
    """README.md's table of run_on_device.sh's steps names each step by its summary line: every
    name it lists is one the script writes, and every stage the script runs is listed."""
    script = DEVICE_SCRIPT.read_text()
    # `stage NAME ...` runs a step; `printf '%-22s ...' NAME` writes a summary line of its own.
    staged = set(re.findall(r'\bstage "?([\w$-]+)"? \d+ "\$WORK/', script))
    printed = set(re.findall(r"printf '%-22s[^']*' \"?([a-z][\w$-]*)", script))
    assert {"env", "build", "gpu-tests", "bench-trees", "sanitizer-$tool"} <= staged, staged

    def pattern(name: str) -> re.Pattern:             # $tool, $pt, ...: any word; README's *
        return re.compile(re.sub(r"\\\$\w+", r"[\\w*-]+", re.escape(name)))

    readme = (GPU_DIR / "README.md").read_text()
    section = readme.split("## The kernel: run_on_device.sh", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    listed = [n for ln in rows for n in re.findall(r"`([\w*-]+)`", ln.split("|")[1])]
    assert len(rows) >= 10 and "bench-trees" in listed, listed
    for name in listed:
        assert any(pattern(s).fullmatch(name) for s in staged | printed), f"no step {name!r}"
    for s in staged:
        assert any(pattern(s).fullmatch(name) for name in listed), f"README lacks {s!r}"


# ---- the overlapped final launch wrong on the GPU: a tests run turns it off for later runs

def _fake_pytest_python(path: Path, record: Path, main_failures: list[str], rerun_rc: int) -> Path:
    """A stand-in python: pytest writes junit XML (the main GPU run fails main_failures, the rerun
    exits rerun_rc) and records its marker expression, node ids and CHUNKATTN_OVERLAP_FINAL; the
    bench records the knob; junit.py runs for real; everything else 'passes'."""
    import sys
    path.write_text(f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
if args and args[0].endswith("junit.py"):
    os.execv({sys.executable!r}, [{sys.executable!r}] + args)
if args == ["-"]:
    sys.stdin.read()
knob = os.environ.get("CHUNKATTN_OVERLAP_FINAL")
with open({str(record)!r}, "a") as rec:
    if args[:2] == ["-m", "pytest"]:
        marks = args[args.index("-m", 2) + 1] if "-m" in args[2:] else ""    # host tests: none
        ids = [a for a in args if "::" in a]
        rec.write(json.dumps(dict(pytest=marks, ids=ids, knob=knob)) + "\\n")
        failing = {main_failures!r} if marks == "gpu and not timeline" else []
        rc = {rerun_rc} if ids else (1 if failing else 0)
        cases = "".join(
            f'<testcase classname="tests.kernels.test_ops_cuda" name="{{n.split("::")[1]}}">'
            + ('<failure message="x"/>' if n in failing else "") + "</testcase>"
            for n in failing + ["tests/kernels/test_ops_cuda.py::test_fine"])
        xml = next(a.split("=", 1)[1] for a in args if a.startswith("--junitxml="))
        with open(xml, "w") as f:
            f.write(f'<testsuites><testsuite tests="{{len(failing) + 1}}" failures="{{len(failing)}}" '
                    f'errors="0" skipped="0">{{cases}}</testsuite></testsuites>')
        sys.exit(rc)
    if "vllm_chunkattn.bench" in args:
        rec.write(json.dumps(dict(bench=" ".join(args[2:4]), knob=knob)) + "\\n")
""")
    path.chmod(0o755)
    return path


OVERLAP_BROKE = ["tests/kernels/test_ops_cuda.py::test_final_launch_overlapped_or_not[batch_17-overlap_on]",
                 "tests/kernels/test_ops_cuda.py::test_tree_specs[batch_17-dtype0]"]


def _records(record: Path) -> list[dict]:
    import json
    return [json.loads(x) for x in record.read_text().splitlines()]


def test_failures_the_serial_final_launch_fixes_turn_the_overlap_off_for_later_runs(tmp_path):
    record = tmp_path / "record"
    fake_py = _fake_pytest_python(tmp_path / "python", record, OVERLAP_BROKE, rerun_rc=0)
    knobs_env = tmp_path / "knobs.env"
    env = _detached_env(tmp_path, fake_py, KNOBS_ENV=str(knobs_env))
    r = subprocess.run(["bash", str(DEVICE_SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                       env={**env, "STAGES": "tests bench-detach"}, timeout=120)
    summary = (tmp_path / "out" / "summary.md").read_text()
    pid = int((tmp_path / "bench" / "pid").read_text())
    try:
        assert r.returncode == 0, summary
        runs = [x for x in _records(record) if "pytest" in x]
        main, rerun = runs[0], runs[1]
        assert main == dict(pytest="gpu and not timeline", ids=[], knob=None)
        # only what failed, serialised, without the tests that force the overlap on
        assert rerun == dict(pytest="gpu and not overlap_on", ids=OVERLAP_BROKE, knob="0")
        assert re.search(r"overlap-final +OFF for this host: the 2 failed GPU tests", summary)
        assert knobs_env.read_text() == "export CHUNKATTN_OVERLAP_FINAL=0\n"
        assert re.search(r"bench-detach +started", summary), summary
        subprocess.run(["bash", str(DETACHED), "wait"], env=env, capture_output=True, timeout=60)
        benches = [x for x in _records(record) if "bench" in x]
        assert benches and all(x["knob"] == "0" for x in benches), benches
        printed = subprocess.run(["bash", str(INSTALL), "env"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=30).stdout
        assert "export CHUNKATTN_OVERLAP_FINAL=0" in printed        # the servers get it too
    finally:
        _end_session(pid)


def test_a_failure_the_serial_final_launch_does_not_fix_stops_the_bench(tmp_path):
    record = tmp_path / "record"
    fake_py = _fake_pytest_python(tmp_path / "python", record, OVERLAP_BROKE, rerun_rc=1)
    knobs_env = tmp_path / "knobs.env"
    knobs_env.write_text("export CHUNKATTN_OVERLAP_FINAL=0\n")      # an earlier run's verdict
    env = _detached_env(tmp_path, fake_py, KNOBS_ENV=str(knobs_env))
    r = subprocess.run(["bash", str(DEVICE_SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                       env={**env, "STAGES": "tests bench-detach"}, timeout=120)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert r.returncode == 1, summary
    assert "overlap-final" not in summary and not knobs_env.exists()      # decided afresh
    assert re.search(r"bench-detach +SKIPPED \(a test or the sanitizer failed\)", summary)
    assert [x["knob"] for x in _records(record) if "pytest" in x][:1] == [None]


def test_ncu_stage_profiles_each_point_in_its_own_process(tmp_path):
    """STAGES=ncu: a stand-in ncu on PATH (it writes the CSV Nsight Compute would, for the point
    its command line names) runs once per point of ncu_points.py, and the summary gets their
    table from the real --summary."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "ncu").write_text(f"""#!/bin/sh
log=""; prev=""; for a in "$@"; do [ "$prev" = "--log-file" ] && log=$a; prev=$a; done
point=$(eval echo \\${{$#}})
echo "$*" >> {calls}
head='"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
launch='"0","1","python3","h","void chunkattn::tpp_final_kernel<__half, 128>(chunkattn::TppParams)","1","7","(128, 1, 1)","(32, 32, 1)","0","9.0"'
case "$*" in
  *issue_stalled*) printf '%s\\n' "$head" \\
    "$launch"',"Command line profiler metrics","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","ratio","0.50"' \\
    "$launch"',"Command line profiler metrics","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","ratio","3.20"' \\
    "$launch"',"Command line profiler metrics","smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio","ratio","1.90"' > "$log" ;;
  *) printf '%s\\n' "$head" "$launch"',"GPU Speed Of Light Throughput","DRAM Throughput","%","8'"$point"'"' \\
       "==PROF== Disconnected from process 1" > "$log" ;;   # ncu's own line: not a launch
esac
""")
    (bin_dir / "ncu").chmod(0o755)
    r, summary = _run_with_stand_ins(tmp_path, bin_dir, "ncu", f"""
case "$*" in *"ncu_points.py --summary"*) exec {sys.executable} "$@" ;; esac
exit 0""")
    assert r.returncode == 0, summary
    points = ("llama_serve", "paper_shared", "paper_private", "llama_capacity")
    stalled = ("llama_serve", "paper_shared", "llama_capacity")
    ran = calls.read_text().splitlines()
    # the served shape first (the time limit cuts the last stages), then the stall reasons' metrics
    # at it and the two latency-bound points, a process each
    assert [line.split()[-1] for line in ran] == [*points, *stalled]
    assert all("--clock-control none" in line and "-k regex:tpp_" in line for line in ran)
    assert ["issue_stalled" in line for line in ran] == [False] * 4 + [True] * 3
    assert all("--section ComputeWorkloadAnalysis" in line for line in ran[:4])
    for p in points:
        assert re.search(rf"ncu-{p} +ok", summary), summary
        assert f"| {p} | void chunkattn::tpp_final_kernel |  | 8{p} % |" in summary, summary
    for p in stalled:
        assert re.search(rf"ncu-stalls-{p} +ok", summary), summary
        # largest first, the reason's name without the metric's prefix and suffix
        assert (f"| {p} | void chunkattn::tpp_final_kernel | long_scoreboard 3.20, no_instruction 1.90, "
                "barrier 0.50 |") in summary, summary
