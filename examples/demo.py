"""Demo: the same requests through stock vLLM and through `--attention-backend CUSTOM`.

Serves the embedded tiny model twice on loopback (stock and with the flag, both up), sends a batch
of requests that share a long system prompt to each in turn (stock, CUSTOM, CUSTOM, stock, ...),
and ends with one screen: some answers, whether the two systems produced the same tokens, decode
tok/s of each, the KV tokens each held at peak, and how much of CUSTOM's decode KV reads the shared
chunks served.

    python examples/demo.py [--model DIR] [--requests 64] [--system-words 3500] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from vllm_chunkattn.bench.ab import STATS_INTERVAL_S
from vllm_chunkattn.bench.serve_steps import peak_kv_usage_pct
from vllm_chunkattn.bench.server_client import kv_capacity_tokens
from vllm_chunkattn.bench.server_process import ServerError, ServerProcess
from vllm_chunkattn.tiny_model import _WORDS, ensure_tiny_model

QUESTIONS = [
    "what is the best way to write code", "tell me one fact about language",
    "why do people ask questions", "how can a model help a user", "give me an example list",
    "what should we do first", "which tool would you use", "when is the answer right",
    "who can read this data", "where do we find information", "how long is a day",
    "what does this function do",
]
SHOWN_ANSWERS = 4


def questions(n: int) -> list[str]:
    """n different questions: the list, then pairs of its questions."""
    k = len(QUESTIONS)
    return [QUESTIONS[i] if i < k else f"{QUESTIONS[i % k]} and {QUESTIONS[(i + i // k) % k]}"
            for i in range(n)]


def complete(url: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """The prompts as one streamed greedy completion request (a prompt list): vLLM's API server
    hands them to the engine at once, so both systems decode the same batch however loaded the
    machine is (sent as one HTTP request each, on a busy 2-core machine stock's server took the
    last two only after the first two had finished). Per prompt: its text, token ids, and the
    arrival time of each token."""
    body = json.dumps({"model": "tiny", "prompt": prompts, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    out = [{"text": "", "token_ids": [], "times": []} for _ in prompts]
    with urllib.request.urlopen(req, timeout=900) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            for choice in json.loads(line[6:])["choices"]:
                one = out[choice["index"]]
                ids = choice.get("token_ids") or []
                one["text"] += choice.get("text", "")
                one["token_ids"] += ids
                one["times"] += [now] * len(ids)
    return out


def decode_tok_s(results: list[dict]) -> float:
    """Tokens a second while every request of the batch decodes: the tokens that arrived after
    the last request's first token and up to the first request's last one, over that time (no
    prefill, no ramp). A batch too short for such a window: all tokens after each request's
    first, over first to last token of any request."""
    start, end = max(r["times"][0] for r in results), min(r["times"][-1] for r in results)
    tokens = sum(start < t <= end for r in results for t in r["times"])
    if tokens and end > start:
        return tokens / (end - start)
    span = max(r["times"][-1] for r in results) - min(r["times"][0] for r in results)
    decoded = sum(len(r["times"]) - 1 for r in results)
    return decoded / span if span > 0 else float("nan")


def start(servers: dict, name: str, label: str, model: str, flags: list[str], port: int | None,
          env: dict, log: Path) -> None:
    """Starts one server and adds it to `servers` (whoever holds that dict stops them all)."""
    print(f"starting vLLM ({label}) on {model} ...", flush=True)
    servers[name] = ServerProcess(model, flags, port=port, env=env, log_path=log)
    servers[name].start()
    banner = [ln for ln in servers[name].lines if "ChunkAttention backend" in ln]
    if banner:
        print("  server:", banner[-1].split("] ", 1)[-1])


def ask_in_turn(servers: dict[str, ServerProcess], system: str, prompts: list[str],
                max_tokens: int, rounds: int) -> dict[str, list[list[dict]]]:
    """Each server first gets the system prompt alone (its KV is then cached: the rounds measure
    decode, not the long prefill), then the batch `rounds` times, in ABBA order so that a change
    in the machine's load between rounds weighs on both alike."""
    for server in servers.values():
        complete(server.url, [system], 2)
    names = list(servers)
    order = [names[(i % 4) in (1, 2)] for i in range(2 * rounds)]    # A B B A A B B A ...
    runs = {name: [] for name in names}
    for i, name in enumerate(order, 1):
        print(f"  round {i} of {len(order)}: {name}", flush=True)
        runs[name].append(complete(servers[name].url, prompts, max_tokens))
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: the embedded tiny model)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--system-words", type=int, default=3500)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="batches each system serves")
    p.add_argument("--port", type=int, default=None, help="stock's port; CUSTOM's is the next")
    p.add_argument("--dtype", default="float32",
                   help="float32 (default): the exactness setting; bfloat16: the CPU kernels' "
                        "fast path, where rounding may flip a near-tied greedy token")
    args = p.parse_args(argv)

    model = args.model or str(ensure_tiny_model())
    rng = random.Random(0)
    # Only in-vocabulary words: the tiny model's tokenizer is word-level.
    system = "you are a helpful assistant " + " ".join(rng.choice(_WORDS)
                                                       for _ in range(args.system_words))
    asked = questions(args.requests)
    prompts = [f"{system} question {q}" for q in asked]
    work = Path(tempfile.mkdtemp(prefix="chunkattn-demo-"))
    stats_file = work / "sharing.json"
    # The step log gives KV usage to 0.1 % of the cache: for the embedded model (4 KiB of KV a
    # token in fp32) a cache just large enough for the requests unshared, 64 MiB at least (16
    # tokens in 0.1 %); 1 GiB for a model of --model.
    longest = args.system_words + 64 + args.max_tokens
    kv_bytes = (1 << 30) if args.model else max(64 << 20, args.requests * longest * 4096)
    common = ["--served-model-name", "tiny", "--dtype", args.dtype, "--block-size", "64",
              "--max-model-len", str(max(4096, longest)), "--kv-cache-memory-bytes",
              str(kv_bytes), "--enforce-eager", "--enable-logging-iteration-details"]
    custom_env = {"CHUNKATTN_STATS_FILE": str(stats_file),
                  "CHUNKATTN_STATS_INTERVAL_S": str(STATS_INTERVAL_S)}
    servers: dict[str, ServerProcess] = {}
    try:
        start(servers, "stock", "stock", model, common, args.port, {}, work / "stock.log")
        start(servers, "CUSTOM", "--attention-backend CUSTOM", model,
              common + ["--attention-backend", "CUSTOM"], args.port and args.port + 1, custom_env,
              work / "custom.log")
        capacity = {name: kv_capacity_tokens(s.url) for name, s in servers.items()}
        runs = ask_in_turn(servers, system, prompts, args.max_tokens, args.rounds)
        # The worker writes its counters at most once a second (every step would slow the very
        # decode we measure): one more short request after a quiet second flushes them.
        time.sleep(STATS_INTERVAL_S + 0.1)
        complete(servers["CUSTOM"].url, ["a"], 2)
    except ServerError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    finally:
        for server in servers.values():
            server.stop()
    peak_kv = {}
    for name, log in (("stock", work / "stock.log"), ("CUSTOM", work / "custom.log")):
        # any step's highest usage, from the step log (--enable-logging-iteration-details):
        # /metrics samples every 0.2 s missed a run this short, and showed 0 for either system
        peak = peak_kv_usage_pct(log.read_text(errors="replace"))    # the server has stopped
        peak_kv[name] = None if math.isnan(peak) else round(peak / 100 * capacity[name])
    report(args, asked, runs, peak_kv, json.loads(stats_file.read_text()))
    return 0


def report(args, asked: list[str], runs: dict, peak_kv: dict, stats: dict) -> None:
    print(f"\n{args.requests} requests sharing a system prompt of {args.system_words + 5} words, "
          f"{args.max_tokens} greedy tokens each, {args.dtype}, 2 systems, "
          f"{args.rounds} rounds each:\n")
    if args.model is None:
        print("  The tiny model's weights are random, so its words mean nothing: the two systems "
              "are compared on the token ids they chose.")
    for question, r in list(zip(asked, runs["CUSTOM"][0]))[:SHOWN_ANSWERS]:
        print(f"  Q: {question}\n  A: {r['text'].strip()[:100]}")
    if args.requests > SHOWN_ANSWERS:
        print(f"  ... and {args.requests - SHOWN_ANSWERS} more")
    # A request counts as the same when every round of both systems gave it the same token ids.
    same = sum(all(run[i]["token_ids"] == runs["stock"][0][i]["token_ids"]
                   for system in runs.values() for run in system)
               for i in range(args.requests))
    per_round = {name: [decode_tok_s(run) for run in system] for name, system in runs.items()}
    tok_s = {name: statistics.median(rates) for name, rates in per_round.items()}
    share = stats["shared_kv_tokens"] / max(stats["kv_tokens"], 1)
    print("\n                        stock      CUSTOM")
    print(f"  decode tok/s      {tok_s['stock']:10.0f}  {tok_s['CUSTOM']:10.0f}"
          f"   ({tok_s['CUSTOM'] / tok_s['stock']:.2f}x; while all requests decode, median "
          "of the rounds)")
    rounds = [" ".join(f"{x:.0f}" for x in per_round[name]) for name in ("stock", "CUSTOM")]
    print(f"  each round        {rounds[0]:>10}  {rounds[1]:>10}")
    kv = [f"{'(no log)':>10}" if peak_kv[name] is None else f"{peak_kv[name]:10d}"
          for name in ("stock", "CUSTOM")]
    print(f"  peak KV tokens    {kv[0]}  {kv[1]}"
          "   (any step's; stock's prefix caching shares the prompt's blocks too)")
    differ = args.requests - same
    print(f"  same token ids    {same} of {args.requests} requests"
          + ("" if not differ else f"  <- {differ} differ: report this"))
    print(f"\nCUSTOM's decode: {stats['decode_steps']} steps; {100 * share:.1f}% of the KV tokens "
          f"it attended to came from chunks shared by several rows of the step, read once for "
          f"all of them.")
    print("Each decode step, stock reads the shared prompt's KV once per request and CUSTOM once "
          "for the batch; realistic models are measured in benchmarks/results (README).")


if __name__ == "__main__":
    sys.exit(main())
