"""Demo: vLLM serving the embedded tiny model with `--attention-backend CUSTOM`.

Starts the server on loopback, sends requests that share a long system prompt (concurrently, so
they decode together), prints the answers and how much of the decode's KV reads the shared chunks
served, then stops the server.

    python examples/demo.py [--model DIR] [--requests 8] [--system-words 1024]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_chunkattn.serve import ServerError, ServerProcess
from vllm_chunkattn.tiny_model import _WORDS, ensure_tiny_model

QUESTIONS = [
    "what is the best way to write code", "tell me one fact about language",
    "why do people ask questions", "how can a model help a user", "give me an example list",
    "what should we do first", "which tool would you use", "when is the answer right",
    "who can read this data", "where do we find information", "how long is a day",
    "what does this function do",
]


def complete(url: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: the embedded tiny model)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--system-words", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--port", type=int, default=None)
    args = p.parse_args(argv)

    model = args.model or str(ensure_tiny_model())
    rng = random.Random(0)
    # Only in-vocabulary words: the tiny model's tokenizer is word-level.
    system = "you are a helpful assistant " + " ".join(rng.choice(_WORDS)
                                                       for _ in range(args.system_words))
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.requests)]
    prompts = [f"{system} question {q}" for q in questions]
    stats_file = Path(tempfile.mkdtemp(prefix="chunkattn-demo-")) / "sharing.json"
    server_args = ["--served-model-name", "tiny", "--attention-backend", "CUSTOM",
                   "--dtype", "float32", "--block-size", "64", "--max-model-len", "4096",
                   "--kv-cache-memory-bytes", str(1 << 30), "--enforce-eager"]
    print(f"starting vLLM with --attention-backend CUSTOM on {model} ...", flush=True)
    try:
        with ServerProcess(model, server_args, port=args.port,
                           env={"CHUNKATTN_STATS_FILE": str(stats_file),
                                "CHUNKATTN_STATS_INTERVAL_S": "0"}) as server:
            banner = [ln for ln in server.lines if "ChunkAttention backend" in ln]
            print("server:", banner[-1].split("] ", 1)[-1] if banner else "(no banner?)")
            t0 = time.monotonic()
            with ThreadPoolExecutor(args.requests) as pool:
                results = list(pool.map(lambda q: complete(server.url, q, args.max_tokens),
                                        prompts))
            elapsed = time.monotonic() - t0
    except ServerError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    prompt_tokens = results[0]["usage"]["prompt_tokens"]
    print(f"\n{args.requests} requests, each {prompt_tokens} prompt tokens "
          f"(shared system prompt of {args.system_words + 4} words), {elapsed:.1f}s\n")
    for question, r in zip(questions, results):
        print(f"  Q: {question}\n  A: {r['choices'][0]['text'].strip()[:100]}")
    stats = json.loads(stats_file.read_text())
    share = stats["shared_kv_tokens"] / max(stats["kv_tokens"], 1)
    print(f"\ndecode steps: {stats['decode_steps']}, decode rows: {stats['decode_rows']}")
    print(f"KV tokens the decode attended to: {stats['kv_tokens']}; of those, "
          f"{stats['shared_kv_tokens']} ({100 * share:.1f}%) came from chunks shared with other "
          f"rows of the same step and were read once for all of them")
    print(f"most KV tokens shared in one step: {stats['max_shared_kv_tokens_per_step']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
