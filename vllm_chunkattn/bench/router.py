"""`python -m vllm_chunkattn.bench router`: CUSTOM replicas behind vllm-router, one shared-prefix
workload through each routing policy, and one replica alone as the reference.

    pip install vllm-router     # the router (a Rust binary with a Python entry point)
    python -m vllm_chunkattn.bench router --out benchmarks/results/router_cpu

The workload: G prefix groups (a system prompt of P words each) x Q questions, shuffled,
arriving at R per second (Poisson) with at most C in flight, greedy. Per policy, replicas start
fresh (empty caches); after the run each replica's /metrics gives the prefix-cache hit rate (vLLM's counters), the decode sharing (KV reads served
by shared chunks, `chunkattn:decode_shared_kv_tokens_total / decode_kv_tokens_total`) and the KV
tokens the replicas hold (chunks in use + cached): a policy that spreads a group over replicas
prefills and stores its prefix on each. `kv_aware` routes on the replicas' KV events
(`--kv-events-config`, vLLM's ZMQ publisher), which the tree publishes; `kv_aware_session` adds
its session affinity, each request naming its prefix group as its session. The client's output
tok/s and TTFT are shown too (on a shared CPU they move with the machine's load).

vllm-router's prefix-aware policies route on token ids: for a text prompt it asks every replica
for them (`/v1/completions/render`, within 1 s), which vLLM serves only with `--enable-scale-out`;
without it (`--no-scale-out`) every answer is a 403 and the router places each request on load
alone. The router's own decision counters (its Prometheus endpoint) are reported per policy.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_chunkattn.bench import provenance
from vllm_chunkattn.bench.server_client import SERVED_NAME, percentile, post, scrape
from vllm_chunkattn.bench.server_process import ServerProcess, free_port
from vllm_chunkattn.tiny_model import _WORDS

POLICIES = ("round_robin", "cache_aware", "kv_aware", "kv_aware_session")
# kv_aware_session: kv_aware with its session affinity, each request naming its prefix group as
# its session (`x-session-id`): a group's first request is placed on the KV events, the rest follow.
SESSION_TTL_S = 600
REPLICA_ARGS = ("--attention-backend CUSTOM --dtype float32 --block-size {bs} "
                "--max-model-len 2048 --kv-cache-memory-bytes {kv_bytes} --enforce-eager "
                "--served-model-name " + SERVED_NAME)
SCALE_OUT_ARGS = ["--enable-scale-out"]      # vLLM's render endpoints, for the router


def workload(groups: int, questions: int, prefix_words: int, question_words: int,
             seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(_WORDS) for _ in range(prefix_words)) for _ in range(groups)]
    prompts = [f"{p} {' '.join(rng.choice(_WORDS) for _ in range(question_words))}"
               for p in prefixes for _ in range(questions)]
    rng.shuffle(prompts)
    return prompts


def prefix_groups(prompts: list[str], prefix_words: int) -> list[str]:
    """Each prompt's prefix group, named in the order the groups first arrive."""
    names: dict[str, str] = {}
    return [names.setdefault(" ".join(p.split()[:prefix_words]), f"group{len(names)}")
            for p in prompts]


def start_replicas(n: int, model: str, args: argparse.Namespace, with_events: bool
                   ) -> tuple[list[ServerProcess], list[str]]:
    servers, event_urls = [], []
    cores = os.cpu_count() or 1
    for i in range(n):
        flags = REPLICA_ARGS.format(bs=args.block_size, kv_bytes=args.kv_cache_bytes).split()
        if args.scale_out:
            flags += SCALE_OUT_ARGS
        if with_events:
            port = free_port()
            flags += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://*:{port}"})]
            event_urls.append(f"tcp://127.0.0.1:{port}")
        # One core per replica where there are enough (vLLM's CPU worker binds its threads).
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(i % cores), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        servers.append(ServerProcess(model, flags, env=env,
                                     log_path=args.out / f"replica{i}.log"))
    for server in servers:
        server.start()
    return servers, event_urls


class Router:
    """vllm-router in front of the replicas, stopped with them."""

    def __init__(self, policy: str, worker_urls: list[str], event_urls: list[str],
                 block_size: int, log_path: Path):
        beside = Path(sys.executable).with_name("vllm-router")     # this venv's, off PATH
        exe = str(beside) if beside.exists() else shutil.which("vllm-router")
        if exe is None:
            raise SystemExit("vllm-router is not installed: pip install vllm-router")
        self.port, self.metrics_port = free_port(), free_port()
        cmd = [exe, "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
               "--worker-urls", *worker_urls]
        if policy == "kv_aware_session":
            cmd[cmd.index(policy)] = "kv_aware"
            cmd += ["--kv-aware-session-affinity-ttl-secs", str(SESSION_TTL_S)]
        if policy.startswith("kv_aware"):
            cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", SERVED_NAME]
            for url, endpoint in zip(worker_urls, event_urls):
                cmd += ["--kv-event-source", f"{url}={endpoint}"]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise SystemExit(f"vllm-router exited: see {log_path}")
                time.sleep(0.5)
        raise SystemExit(f"vllm-router not ready after 60 s: see {log_path}")

    def decisions(self) -> str:
        """What the router's prefix-aware policy decided, from its own counters: e.g.
        `outcome=prefix_hit:40 outcome=missing_tokens:24` (missing tokens: routed on load)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return "n/a"
        counts: dict[str, float] = {}
        for line in text.splitlines():
            m = _DECISION.match(line)
            if m:
                key = f"{m['label']}={m['value']}"
                counts[key] = counts.get(key, 0.0) + float(m["count"])
        return " ".join(f"{k}:{v:g}" for k, v in sorted(counts.items())) or "none"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# The router's per-request routing outcome and its token-input preparation, by label.
_DECISION = re.compile(r'^vllm_router_(?:prefix_routing_decisions|kv_routing_inputs)_total'
                       r'\{[^}]*?(?P<label>outcome|result)="(?P<value>[^"]+)"[^}]*\}'
                       r'\s+(?P<count>\S+)$')


def stream(url: str, prompt: str, max_tokens: int, session: str | None = None
           ) -> tuple[float, float, int]:
    """One streamed completion: (TTFT s, latency s, output tokens)."""
    body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    headers = {"Content-Type": "application/json"}
    if session is not None:
        headers["x-session-id"] = session
    req = urllib.request.Request(url + "/v1/completions", body, headers)
    start, first, tokens = time.perf_counter(), None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            first = first or time.perf_counter()
            tokens += 1
    return (first or time.perf_counter()) - start, time.perf_counter() - start, tokens


def drive(url: str, prompts: list[str], concurrency: int, max_tokens: int,
          request_rate: float, sessions: list[str] | None = None) -> dict:
    """Requests arrive at `request_rate` per second (Poisson, seeded), at most `concurrency`
    in flight: a prefix-aware router learns where a group went before most of it arrives."""
    rng = random.Random(1)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        futures = []
        for i, prompt in enumerate(prompts):
            futures.append(pool.submit(stream, url, prompt, max_tokens,
                                       sessions[i] if sessions else None))
            if request_rate > 0:
                time.sleep(rng.expovariate(request_rate))
        results = [f.result() for f in futures]
    duration = time.perf_counter() - start
    ttfts = [t for t, _, _ in results]
    return {"output_tok_s": sum(n for *_, n in results) / duration,
            "median_ttft_ms": 1e3 * percentile(ttfts, 50),
            "p90_ttft_ms": 1e3 * percentile(ttfts, 90), "completed": len(results)}


def replica_metrics(servers: list[ServerProcess], block_size: int) -> dict:
    totals: dict[str, float] = {}
    per_replica = []
    for server in servers:
        m = scrape(server.url, prefixes=("vllm:", "chunkattn:"))
        per_replica.append(m.get("vllm:request_success_total", 0.0))
        for name, value in m.items():
            totals[name] = totals.get(name, 0.0) + value
    queries = totals.get("vllm:prefix_cache_queries_total", 0.0)
    kv = totals.get("chunkattn:decode_kv_tokens_total", 0.0)
    return {"prefix_hit_rate": totals.get("vllm:prefix_cache_hits_total", 0.0) / queries
            if queries else 0.0,
            "decode_sharing": totals.get("chunkattn:decode_shared_kv_tokens_total", 0.0) / kv
            if kv else 0.0,
            "kv_tokens_held": block_size * int(totals.get("chunkattn:chunks_in_use", 0)
                                               + totals.get("chunkattn:chunks_cached", 0)),
            "requests_per_replica": "/".join(str(int(n)) for n in per_replica)}


def run_policy(policy: str | None, replicas: int, model: str, prompts: list[str],
               args: argparse.Namespace) -> dict:
    """`policy` None: one replica, requests sent to it directly."""
    servers, event_urls = start_replicas(replicas, model, args,
                                         (policy or "").startswith("kv_aware"))
    router = None
    try:
        url = servers[0].url
        if policy is not None:
            router = Router(policy, [s.url for s in servers], event_urls, args.block_size,
                            args.out / f"router_{policy}.log")
            url = router.url
        post(url + "/v1/completions", {"model": SERVED_NAME, "prompt": "you are",
                                       "max_tokens": 2})     # warm-up, before the cache counts
        result = drive(url, prompts, args.concurrency, args.output_len, args.request_rate,
                       args.sessions if policy == "kv_aware_session" else None)
        time.sleep(1.0)                     # the last step's gauges reach /metrics
        result.update(replica_metrics(servers, args.block_size))
        result["router_decisions"] = router.decisions() if router else "-"
    finally:
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()
    return {"policy": policy or "one replica", "replicas": replicas, **result}


COLUMNS = ("policy", "replicas", "requests_per_replica", "prefix_hit_rate", "decode_sharing",
           "kv_tokens_held", "output_tok_s", "median_ttft_ms", "p90_ttft_ms", "router_decisions")


def report(rows: list[dict], args: argparse.Namespace, command: str) -> None:
    lines = [f"# CUSTOM replicas behind vllm-router: {args.groups} prefix groups x "
             f"{args.questions} questions", "",
             f"- command: `{command}`", f"- machine: {provenance.machine()}",
             f"- commit: {provenance.git_commit()}",
             f"- load: {args.groups * args.questions} requests, prefixes of {args.prefix_words} "
             f"words, questions of {args.question_words}, {args.output_len} greedy tokens, "
             f"{args.request_rate:g} arrivals/s (Poisson; 0: all at once), at most "
             f"{args.concurrency} in flight, shuffled; tiny model, fp32, block size "
             f"{args.block_size}; replicas "
             + ("with `--enable-scale-out`" if args.scale_out else "without `--enable-scale-out`")
             + " (vLLM's render endpoints, where vllm-router gets token ids)",
             "- router_decisions: vllm-router's own counters (`outcome`: how its prefix-aware "
             "policy placed each request; `missing_tokens`: no token ids from the replicas, "
             "placed on load; `result`: how it got them)",
             "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else
                                       str(row[c]) for c in COLUMNS) + " |")
    (args.out / "router.md").write_text("\n".join(lines) + "\n")
    (args.out / "router.json").write_text(json.dumps(rows, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [r["policy"] for r in rows]
    axes[0].bar(names, [r["decode_sharing"] for r in rows], color="tab:blue")
    axes[0].set_title("decode KV reads served by shared chunks")
    axes[1].bar(names, [r["kv_tokens_held"] for r in rows], color="tab:orange")
    axes[1].set_title("KV tokens held (all replicas)")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(args.out / "router.png", dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench router",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded tiny model")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--prefix-words", type=int, default=512)
    p.add_argument("--question-words", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=4.0,
                   help="arrivals per second (Poisson); 0: all at once")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    p.add_argument("--scale-out", action=argparse.BooleanOptionalAction, default=True,
                   help="start the replicas with --enable-scale-out (default)")
    p.add_argument("--out", type=Path, default=Path("router_results"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from vllm_chunkattn.tiny_model import ensure_tiny_model
    model = args.model or str(ensure_tiny_model(Path("models/tiny-llama")))
    prompts = workload(args.groups, args.questions, args.prefix_words, args.question_words)
    args.sessions = prefix_groups(prompts, args.prefix_words)
    rows = [run_policy(None, 1, model, prompts, args)]
    for policy in filter(None, args.policies.split(",")):
        rows.append(run_policy(policy, args.replicas, model, prompts, args))
        print(json.dumps(rows[-1]), flush=True)
    command = "python -m vllm_chunkattn.bench router " + " ".join(argv or [])
    report(rows, args, command)
    print((args.out / "router.md").read_text())
    return 0
