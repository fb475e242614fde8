"""Demo: the same requests through stock vLLM and through `--attention-backend CUSTOM`.

Serves the embedded tiny model twice on loopback (stock, then with the flag), sends requests that
share a long system prompt (in one request, so they decode together), and ends with one screen: the
answers, whether the two systems produced the same tokens, decode tok/s of each, the KV tokens
each held at peak, and how much of CUSTOM's decode KV reads the shared chunks served.

    python examples/demo.py [--model DIR] [--requests 8] [--system-words 1024]
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from vllm_chunkattn.bench.ab import STATS_INTERVAL_S
from vllm_chunkattn.bench.serve_steps import peak_kv_usage_pct
from vllm_chunkattn.bench.server_client import kv_capacity_tokens
from vllm_chunkattn.serve import ServerError, ServerProcess
from vllm_chunkattn.tiny_model import _WORDS, ensure_tiny_model

QUESTIONS = [
    "what is the best way to write code", "tell me one fact about language",
    "why do people ask questions", "how can a model help a user", "give me an example list",
    "what should we do first", "which tool would you use", "when is the answer right",
    "who can read this data", "where do we find information", "how long is a day",
    "what does this function do",
]


def complete(url: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """The prompts as one streamed greedy completion request (a prompt list): vLLM's API server
    hands them to the engine at once, so both systems decode the same batch however loaded the
    machine is (sent as one HTTP request each, on a busy 2-core machine stock's server took the
    last two only after the first two had finished). Per prompt: its text, token ids, and the
    arrival times of its first and last tokens."""
    body = json.dumps({"model": "tiny", "prompt": prompts, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    out = [{"text": "", "token_ids": [], "first": None, "last": None} for _ in prompts]
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            for choice in json.loads(line[6:])["choices"]:
                one = out[choice["index"]]
                one["text"] += choice.get("text", "")
                one["token_ids"] += choice.get("token_ids") or []
                one["first"] = one["first"] or now
                one["last"] = now
    return out


def serve_and_ask(name: str, model: str, flags: list[str], prompts: list[str], max_tokens: int,
                  port: int | None, env: dict, log: Path) -> dict:
    """Starts one server, sends every prompt at once, stops it. Decode tok/s = tokens after each
    request's first / (last token of any request - first token of any request); peak KV = the
    highest usage of any step in the server's log (--enable-logging-iteration-details: /metrics
    samples every 0.2 s missed a run this short, and showed 0 for either system)."""
    print(f"starting vLLM ({name}) on {model} ...", flush=True)
    with ServerProcess(model, flags, port=port, env=env, log_path=log) as server:
        banner = [ln for ln in server.lines if "ChunkAttention backend" in ln]
        if banner:
            print("  server:", banner[-1].split("] ", 1)[-1])
        capacity = kv_capacity_tokens(server.url)
        results = complete(server.url, prompts, max_tokens)
        if "CHUNKATTN_STATS_FILE" in env:
            # The worker writes its counters at most once a second (every step would slow the
            # very decode we measure): one more short request after a quiet second flushes them.
            time.sleep(STATS_INTERVAL_S + 0.1)
            complete(server.url, ["a"], 2)
    span = max(r["last"] for r in results) - min(r["first"] for r in results)
    decoded = sum(len(r["token_ids"]) - 1 for r in results)
    peak = peak_kv_usage_pct(log.read_text(errors="replace"))    # the server has stopped
    return {"results": results, "decode_tok_s": decoded / span if span > 0 else float("nan"),
            "peak_kv_tokens": None if math.isnan(peak) else round(peak / 100 * capacity)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: the embedded tiny model)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--system-words", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--dtype", default="float32",
                   help="float32 (default): the exactness setting; bfloat16: the CPU kernels' "
                        "fast path, where rounding may flip a near-tied greedy token")
    args = p.parse_args(argv)

    model = args.model or str(ensure_tiny_model())
    rng = random.Random(0)
    # Only in-vocabulary words: the tiny model's tokenizer is word-level.
    system = "you are a helpful assistant " + " ".join(rng.choice(_WORDS)
                                                       for _ in range(args.system_words))
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.requests)]
    prompts = [f"{system} question {q}" for q in questions]
    work = Path(tempfile.mkdtemp(prefix="chunkattn-demo-"))
    stats_file = work / "sharing.json"
    # The step log gives KV usage to 0.1 % of the cache: for the embedded model (4 KiB of KV a
    # token in fp32) a cache just large enough for the requests unshared, 64 MiB at least (16
    # tokens in 0.1 %); 1 GiB for a model of --model.
    kv_bytes = (1 << 30) if args.model else max(
        64 << 20, args.requests * (args.system_words + args.max_tokens + 64) * 4096)
    common = ["--served-model-name", "tiny", "--dtype", args.dtype, "--block-size", "64",
              "--max-model-len", "4096", "--kv-cache-memory-bytes", str(kv_bytes),
              "--enforce-eager", "--enable-logging-iteration-details"]
    try:
        stock = serve_and_ask("stock", model, common, prompts, args.max_tokens, args.port, {},
                              work / "stock.log")
        custom = serve_and_ask("--attention-backend CUSTOM", model,
                               common + ["--attention-backend", "CUSTOM"], prompts,
                               args.max_tokens, args.port,
                               {"CHUNKATTN_STATS_FILE": str(stats_file),
                                "CHUNKATTN_STATS_INTERVAL_S": str(STATS_INTERVAL_S)},
                               work / "custom.log")
    except ServerError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    report(args, questions, stock, custom, json.loads(stats_file.read_text()))
    return 0


def report(args, questions, stock: dict, custom: dict, stats: dict) -> None:
    print(f"\n{args.requests} requests sharing a system prompt of {args.system_words + 4} words, "
          f"{args.max_tokens} greedy tokens each, {args.dtype}, 2 systems:\n")
    for question, r in zip(questions, custom["results"]):
        print(f"  Q: {question}\n  A: {r['text'].strip()[:100]}")
    differ = sum(a["token_ids"] != b["token_ids"]
                 for a, b in zip(stock["results"], custom["results"]))
    share = stats["shared_kv_tokens"] / max(stats["kv_tokens"], 1)
    print("\n                        stock      CUSTOM")
    print(f"  decode tok/s      {stock['decode_tok_s']:10.0f}  {custom['decode_tok_s']:10.0f}"
          f"   ({custom['decode_tok_s'] / stock['decode_tok_s']:.2f}x)")
    kv = [f"{'(no log)':>10}" if r["peak_kv_tokens"] is None else f"{r['peak_kv_tokens']:10d}"
          for r in (stock, custom)]
    print(f"  peak KV tokens    {kv[0]}  {kv[1]}"
          "   (any step's; stock's prefix caching shares the prompt's blocks too)")
    print(f"  same token ids    {args.requests - differ} of {args.requests} requests"
          + ("" if not differ else f"  <- {differ} differ: report this"))
    print(f"\nCUSTOM's decode: {stats['decode_steps']} steps; {100 * share:.1f}% of the KV tokens "
          f"it attended to came from chunks shared by several rows of the step, read once for "
          f"all of them.")
    print("This 2-layer model spends little of a step in attention; the speed-ups are measured "
          "in benchmarks/results (README).")


if __name__ == "__main__":
    sys.exit(main())
