"""`python -m vllm_chunkattn.bench ab`: stock vLLM vs `--attention-backend CUSTOM`, same workloads.

For each system (stock with prefix caching, CUSTOM, and stock without prefix caching as the
memory baseline, on the rate-inf subset) it starts a server, runs the workloads through vLLM's
own benchmark client (`vllm.benchmarks.serve`, i.e. `vllm bench serve`), stops the server, and
finally writes one report: CSV + markdown + PNG plots.

    python -m vllm_chunkattn.bench ab                     # full run, embedded tiny model
    python -m vllm_chunkattn.bench ab --smoke --out DIR   # CI-sized
    python -m vllm_chunkattn.bench ab --model DIR --server-args "--dtype bfloat16 ..."

Per run: output tok/s, mean/p99 TPOT, normalised latency (end-to-end latency incl. queueing /
output tokens, as the paper), peak KV cache usage and running batch (sampled from the server's
Prometheus /metrics during the run), prefix-cache hit rate, and for CUSTOM the fraction of decode
KV reads served by shared chunks (its $CHUNKATTN_STATS_FILE).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

from vllm_chunkattn.bench import ab_report, provenance
from vllm_chunkattn.bench.server_client import (SERVED_NAME, MetricsSampler, bench_client,
                                               cpu_snapshot, healthy, kv_capacity_tokens,
                                               latency_metrics, log, post, read_stats,
                                               scrape, tiny_request)
from vllm_chunkattn.bench.ab_workloads import (Workload, full_workloads, smoke_workloads,
                                               write_tree_jsonl)
from vllm_chunkattn.bench.model_shapes import has_weights
from vllm_chunkattn.bench.server_process import ServerError, ServerProcess

# Flags added to the common server flags per system. Stock keeps vLLM's default prefix caching
# (it already shares prefix blocks in memory); stock-nopc is the memory baseline the paper's
# "-70..-90 % peak KV" is measured against.
SYSTEMS = {
    "stock": [],
    "custom": ["--attention-backend", "CUSTOM"],
    "stock-nopc": ["--no-enable-prefix-caching"],
}
# stock-nopc re-prefills every shared prefix (2048-token prefills are slow on a CPU), and it is
# only the memory baseline: it runs the rate-inf workloads that the memory table compares.
MEMORY_GROUPS = ("shared", "prefixes", "n", "tree")
MEMORY_SKIP = ("x16prefixes", "1024-x4prefixes")
# What works on CPU for the embedded model (examples/demo.py); CPU_ATTN needs block size % 32.
TINY_SERVER_ARGS = ("--dtype {dtype} --block-size 64 --max-model-len 4096 "
                    "--kv-cache-memory-bytes {kv_bytes} --enforce-eager")
STATS_INTERVAL_S = 1.0      # CUSTOM logs a stats line each flush: keep it rare


def run_workload(server: ServerProcess, system: str, w: Workload, model: str, tmp: Path,
                 cap_s: float, stats_path: Path | None, kv_tokens: int) -> dict:
    # Each run starts from an empty prefix cache (same starting point for both systems; needs
    # VLLM_SERVER_DEV_MODE=1, set when the server starts).
    with contextlib.suppress(OSError):
        post(server.url + "/reset_prefix_cache")
    before = scrape(server.url)
    stats_before = read_stats(stats_path)
    argv = ["--base-url", server.url, "--model", model, "--served-model-name", SERVED_NAME,
            "--num-prompts", str(w.num_prompts), "--request-rate", str(w.request_rate),
            "--seed", "0", "--ignore-eos", "--temperature", "0", "--disable-tqdm",
            "--save-detailed", "--percentile-metrics", "ttft,tpot,itl,e2el"] + w.bench_args
    if w.tree:
        from vllm_chunkattn.tiny_model import _WORDS
        argv += ["--dataset-path", str(write_tree_jsonl(w, tmp / f"{w.name}.jsonl", _WORDS))]
    cpu0 = cpu_snapshot(server)
    sampler = MetricsSampler(server, cap_s)
    sampler.start()
    try:
        res = bench_client(argv, tmp / f"{system}-{w.name}.client.log")
    finally:
        sampler.stop()
    cpu1 = cpu_snapshot(server)
    d_total, d_busy, d_mine = (b - a for a, b in zip(cpu0, cpu1))
    row = {"status": "timeout" if sampler.timed_out else "ok",
           "others_cpu_pct": round(100 * max(d_busy - d_mine, 0) / d_total, 1) if d_total else 0}
    if not sampler.timed_out and not healthy(server):
        row["status"] = "error: server died during the run (its log: --log-dir)"
    if not sampler.timed_out:
        # One decode step after a quiet STATS_INTERVAL_S makes the worker flush its counters.
        time.sleep(STATS_INTERVAL_S + 0.1)
        with contextlib.suppress(OSError):
            tiny_request(server, 2)
        time.sleep(0.2)
        after = scrape(server.url)
    else:
        after = before
    stats_after = read_stats(stats_path)

    d_q = after.get("vllm:prefix_cache_queries_total", 0) - before.get(
        "vllm:prefix_cache_queries_total", 0)
    d_h = after.get("vllm:prefix_cache_hits_total", 0) - before.get(
        "vllm:prefix_cache_hits_total", 0)
    d_kv = stats_after.get("kv_tokens", 0) - stats_before.get("kv_tokens", 0)
    d_shared = stats_after.get("shared_kv_tokens", 0) - stats_before.get("shared_kv_tokens", 0)
    peak_kv = sampler.peak["vllm:kv_cache_usage_perc"]
    row.update(latency_metrics(res, w.n))
    row.update({
        "peak_kv_usage_pct": 100 * peak_kv,
        "peak_kv_tokens": round(peak_kv * kv_tokens),
        "peak_running": int(sampler.peak["vllm:num_requests_running"]),
        "peak_waiting": int(sampler.peak["vllm:num_requests_waiting"]),
        "prefix_cache_hit_pct": 100 * d_h / d_q if d_q else 0.0,
        # Fraction of decode KV reads that came from chunks shared within a step (CUSTOM only).
        "shared_kv_read_pct": 100 * d_shared / d_kv if d_kv else (math.nan if stats_path is None
                                                                  else 0.0),
        "metric_samples": sampler.samples,
    })
    return row


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench ab",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="local model dir (default: embedded tiny model)")
    p.add_argument("--out", default="benchmarks/results", help="report directory")
    p.add_argument("--tag", default=None, help="report file stem ab_<tag> (default cpu / smoke)")
    p.add_argument("--smoke", action="store_true", help="CI-sized: 2 systems, 2 tiny workloads")
    p.add_argument("--systems", default=None,
                   help=f"comma list of {','.join(SYSTEMS)} (default: all; smoke: stock,custom)")
    p.add_argument("--workloads", default=None,
                   help="comma list of name substrings or groups (shared,prefixes,sweep,n,tree)")
    p.add_argument("--time-limit-minutes", type=float, default=None,
                   help="total wall-clock limit, split evenly over systems; runs that do not "
                        "fit are skipped (default 28; smoke 8, a cap for slow CI)")
    p.add_argument("--run-cap-s", type=float, default=240, help="a run is stopped after this")
    p.add_argument("--port", type=int, default=None, help="server port (default: a free one)")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--dtype", default="float32", help="model/KV dtype with the default server "
                   "args (float32 as the demo; bfloat16 is the CPU kernels' fast path)")
    p.add_argument("--server-args", default=None,
                   help="server flags common to all systems (default: the tiny-model CPU set: "
                        + TINY_SERVER_ARGS.format(kv_bytes="<--kv-cache-bytes>", dtype="<--dtype>") + ")")
    p.add_argument("--slo-ms", type=float, default=40.0,
                   help="normalised-latency bound for 'throughput at latency < SLO' (paper: 40)")
    p.add_argument("--log-dir", default=None, help="server/client logs (default: a temp dir)")
    return p.parse_args(argv)


def select(ws: list[Workload], spec: str | None) -> list[Workload]:
    if not spec:
        return ws
    keys = [k.strip() for k in spec.split(",") if k.strip()]
    return [w for w in ws if any(k == w.group or k in w.name for k in keys)]


def main(argv=None) -> int:
    a = parse_args(argv)
    tag = a.tag or ("smoke" if a.smoke else "cpu")
    systems = (a.systems or ("stock,custom" if a.smoke else ",".join(SYSTEMS))).split(",")
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        log(f"ab: unknown system(s) {bad}; choose from {list(SYSTEMS)}")
        return 2
    workloads = select(smoke_workloads() if a.smoke else full_workloads(), a.workloads)
    if not workloads:
        log("ab: no workload matches --workloads")
        return 2
    time_limit_s = 60 * (a.time_limit_minutes or (8 if a.smoke else 28))
    # Quiet the client's own vLLM logging, but not the servers' (their logs explain failures).
    server_log_level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO")
    os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
    import vllm.benchmarks.serve  # noqa: F401  (slow import: keep it out of the first run's window)
    from vllm_chunkattn.tiny_model import ensure_tiny_model
    model = a.model or str(ensure_tiny_model())
    common = shlex.split(a.server_args if a.server_args is not None
                         else TINY_SERVER_ARGS.format(kv_bytes=a.kv_cache_bytes, dtype=a.dtype))
    common += ["--served-model-name", SERVED_NAME]
    if not has_weights(model) and "--load-format" not in common:
        common += ["--load-format", "dummy"]        # a model_shapes config: no weights
    tmp = Path(a.log_dir or tempfile.mkdtemp(prefix="chunkattn-ab-"))
    tmp.mkdir(parents=True, exist_ok=True)
    out = Path(a.out)
    setup = {"model": model, "server_args": shlex.join(common), "systems": systems,
             "commit": provenance.git_commit(), "date": time.strftime("%Y-%m-%d %H:%M"),
             "native": provenance.native_build(),
             "machine": f"{provenance.machine()}, load average {provenance.load_average()}",
             "time_limit_min": time_limit_s / 60, "slo_ms": a.slo_ms, "smoke": a.smoke,
             "workloads": [(w.name, w.num_prompts, w.request_rate, shlex.join(w.bench_args)
                            + (f" --dataset-path <{w.name}.jsonl: system {w.tree['system_len']}"
                               f" -> {w.tree['docs']} docs x {w.tree['doc_len']} -> "
                               f"{w.tree['questions']} questions each>" if w.tree else ""))
                           for w in workloads]}
    log(f"ab: {len(systems)} systems x {len(workloads)} workloads on {model}; time limit "
        f"{time_limit_s / 60:.0f} min; logs in {tmp}")

    # SIGTERM behaves like Ctrl-C: unwind through the `with` so the server is stopped.
    def _term(*_):
        raise KeyboardInterrupt
    old_term = signal.signal(signal.SIGTERM, _term)
    rows: list[dict] = []
    rc = 0
    t_start = time.monotonic()
    try:
        for si, system in enumerate(systems):
            # What is left of the time limit, shared by the systems still to run.
            left = t_start + time_limit_s - time.monotonic()
            sys_deadline = time.monotonic() + left / (len(systems) - si)
            mine = workloads
            if system == "stock-nopc" and len(systems) > 1:
                mine = [w for w in workloads if w.group in MEMORY_GROUPS
                        and not any(k in w.name for k in MEMORY_SKIP)]
                # The goal's row first, in case the time runs out.
                mine.sort(key=lambda w: w.name != "shared2048")
            rc = max(rc, run_system(system, mine, model, common, a, tmp, sys_deadline,
                                    rows, t_start, server_log_level))
    except KeyboardInterrupt:
        log("\nab: interrupted; servers stopped; writing the partial report")
        rc = 130
    except ServerError as e:
        log(f"\nab: {e}")
        rc = 1
    finally:
        signal.signal(signal.SIGTERM, old_term)
    setup["wall_min"] = (time.monotonic() - t_start) / 60
    paths = ab_report.write(rows, setup, out, tag)
    log(f"ab: report: {', '.join(str(p) for p in paths)} ({setup['wall_min']:.1f} min)")
    return rc


def run_system(system: str, workloads: list[Workload], model: str, common: list[str], a,
               tmp: Path, deadline: float, rows: list[dict], t_start: float,
               log_level: str = "INFO") -> int:
    stats_path = tmp / f"{system}.sharing.json" if system == "custom" else None
    env = {"VLLM_SERVER_DEV_MODE": "1",          # for /reset_prefix_cache between runs
           "VLLM_LOGGING_LEVEL": log_level}
    if stats_path:
        stats_path.unlink(missing_ok=True)
        env.update(CHUNKATTN_STATS_FILE=str(stats_path),
                   CHUNKATTN_STATS_INTERVAL_S=str(STATS_INTERVAL_S))
    args = common + SYSTEMS[system]
    log(f"[{_clock(t_start)}] {system}: starting server ({shlex.join(SYSTEMS[system]) or 'stock'})")
    server = ServerProcess(model, args, port=a.port, env=env,
                           log_path=tmp / f"{system}.server.log")
    rc = 0
    # try/finally rather than `with`: a `with` does not call __exit__ when __enter__ (the
    # start-up wait) is interrupted, which would leave the server running after Ctrl-C.
    try:
        server.start()
        tiny_request(server)                      # first-request warm-up outside any run
        kv_tokens = kv_capacity_tokens(server.url)
        log(f"[{_clock(t_start)}] {system}: ready on {server.url}, KV capacity {kv_tokens} tokens")
        for i, w in enumerate(workloads):
            base = {"system": system, "workload": w.name, "group": w.group,
                    "shared_len": w.shared_len, "num_prefixes": w.num_prefixes, "n": w.n,
                    "request_rate": w.request_rate, "num_prompts": w.num_prompts}
            left = deadline - time.monotonic()
            if left < 10:
                rows.append({**base, "status": "skipped (time limit)"})
                log(f"[{_clock(t_start)}] {system} {i + 1}/{len(workloads)} {w.name}: skipped "
                    f"(time limit)")
                continue
            if not healthy(server):               # stopped by the watchdog, or its engine died
                log(f"[{_clock(t_start)}] {system}: server down after the last run; last log "
                    f"lines:\n{server.tail(8)}\n[{_clock(t_start)}] {system}: restarting it")
                server.stop()
                server.start()
                tiny_request(server)
            log(f"[{_clock(t_start)}] {system} {i + 1}/{len(workloads)} {w.name}: "
                f"{w.num_prompts} prompts, rate {w.request_rate:g}/s ...")
            try:
                r = run_workload(server, system, w, model, tmp, min(a.run_cap_s, left),
                                 stats_path, kv_tokens)
            except (OSError, ValueError, RuntimeError) as e:   # client-side failure: next run
                r = {"status": f"error: {e}"[:200]}
                rc = 1
            rows.append({**base, **r})
            log(f"[{_clock(t_start)}]   {_summary(r)}")
    finally:
        server.stop()
    return rc


def _clock(t0: float) -> str:
    s = int(time.monotonic() - t0)
    return f"{s // 60:2d}:{s % 60:02d}"


def _summary(r: dict) -> str:
    if r.get("status") != "ok":
        return r.get("status", "?")
    share = r["shared_kv_read_pct"]
    return (f"{r['output_tok_s']:.0f} out tok/s, TPOT {r['mean_tpot_ms']:.1f}/"
            f"{r['p99_tpot_ms']:.1f} ms (mean/p99), norm lat {r['norm_latency_ms']:.1f} ms/tok, "
            f"peak KV {r['peak_kv_usage_pct']:.1f}% ({r['peak_kv_tokens']} tok), batch "
            f"{r['peak_running']}, prefix hit {r['prefix_cache_hit_pct']:.0f}%"
            + ("" if math.isnan(share) else f", shared KV reads {share:.0f}%")
            + (f", {r['failed']} failed" if r["failed"] else "")
            + (f" [others used {r['others_cpu_pct']:.0f}% of the CPUs]"
               if r["others_cpu_pct"] >= 5 else ""))


if __name__ == "__main__":
    sys.exit(main())
