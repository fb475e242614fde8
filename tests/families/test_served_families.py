"""Served as users serve them: `vllm serve` (python -m vllm_chunkattn.serve) on loopback, stock
and with the flag, on gpt-oss's family checkpoint (sinks, alternating windows) with a 32-bit and
an fp8 KV cache. Concurrent requests sharing a prefix get stock's tokens and logprobs, and the
CUSTOM server decoded them with the native kernel."""
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from families.models import ensure_family_model
from families.test_family_identity import prompts
from vllm_chunkattn.bench.server_process import ServerProcess
from vllm_runs import NEEDS_CPU_FP8, assert_native_kernel

pytestmark = pytest.mark.vllm
FLAGS = ["--served-model-name", "m", "--dtype", "float32", "--block-size", "32",
         "--max-model-len", "1024", "--kv-cache-memory-bytes", str(128 << 20), "--enforce-eager",
         "--max-num-batched-tokens", "256"]


def _complete(url, prompt):
    body = {"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        choice = json.loads(r.read())["choices"][0]["logprobs"]
    return choice["tokens"], choice["token_logprobs"]


def _serve(flags, requests):
    server = ServerProcess(str(ensure_family_model("gpt-oss")), FLAGS + flags)
    with server:
        log = list(server.lines)                             # start-up: the kernel in use
        with ThreadPoolExecutor(len(requests)) as pool:      # all at once: shared decode steps
            answers = list(pool.map(lambda p: _complete(server.url, p), requests))
    return answers, log


@pytest.mark.parametrize("cache_dtype", ("auto", pytest.param("fp8", marks=NEEDS_CPU_FP8)))
def test_served_gpt_oss_matches_stock(cache_dtype):
    greedy, _ = prompts()
    flags = ["--kv-cache-dtype", cache_dtype]
    stock, _ = _serve(flags, greedy)
    custom, log = _serve(flags + ["--attention-backend", "CUSTOM"], greedy)
    assert_native_kernel(log)
    for i, ((tokens_a, lp_a), (tokens_b, lp_b)) in enumerate(zip(stock, custom, strict=True)):
        assert tokens_a == tokens_b, f"request {i}: tokens differ"
        diff = max(abs(x - y) for x, y in zip(lp_a, lp_b))
        assert diff <= 1e-3, f"request {i}: logprob differs by {diff}"
