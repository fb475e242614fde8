"""Speculative decoding served over HTTP: `vllm serve` (stock) vs the same server with
--attention-backend CUSTOM, both with the same --speculative-config (n-gram drafts, and a tiny
seeded EAGLE head), tiny fp32 model, greedy with logprobs. One request first (its system prompt
is cached), then the others at once (they hit it and decode together, the tree sharing its
chunks): the same tokens, logprobs within 1e-3, the same drafted and accepted counts on
/metrics, the verify rows through the native TPP kernel reading the system prompt once."""
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from eagle_draft import eagle_draft
from test_speculative import NGRAM, prompts
from vllm_runs import assert_native_kernel, assert_not_custom, tiny_model

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm_chunkattn.bench.server_client import scrape  # noqa: E402
from vllm_chunkattn.bench.server_process import ServerProcess  # noqa: E402

FLAGS = ["--served-model-name", "tiny", "--dtype", "float32", "--block-size", "32",
         "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager",
         "--seed", "0"]
COUNTS = ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
          "vllm:prefix_cache_hits_total")


def speculative_config(method: str) -> dict:
    if method == "ngram":
        return NGRAM
    return {"method": "eagle", "model": str(eagle_draft()), "num_speculative_tokens": 3}


def complete(url: str, prompt: list[int], max_tokens: int) -> tuple[list[str], list[float]]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200
        choice = json.loads(r.read())["choices"][0]
    return choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]


def serve(method: str, backend: str | None) -> dict:
    flags = FLAGS + ["--speculative-config", json.dumps(speculative_config(method))]
    if backend:
        flags += ["--attention-backend", backend]
    batch, _ = prompts()
    with ServerProcess(str(tiny_model()), flags) as server:
        answers = [complete(server.url, batch[0], 8)]
        with ThreadPoolExecutor(len(batch)) as pool:
            answers += list(pool.map(lambda p: complete(server.url, p, 40), batch))
        metrics = scrape(server.url, prefixes=("vllm:", "chunkattn:"))
        log = "\n".join(server.lines)
    return {"answers": answers, "metrics": metrics, "log": log}


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_served_speculation_matches_stock(method):
    stock, custom = serve(method, None), serve(method, "CUSTOM")
    assert_not_custom(stock["log"])
    assert_native_kernel(custom["log"])
    for i, ((s_tokens, s_lp), (c_tokens, c_lp)) in enumerate(zip(stock["answers"],
                                                                 custom["answers"])):
        assert c_tokens == s_tokens, f"request {i}: tokens differ"
        assert max(abs(a - b) for a, b in zip(s_lp, c_lp)) <= 1e-3, f"request {i}: logprobs"
    want = {name: stock["metrics"][name] for name in COUNTS}
    assert {name: custom["metrics"][name] for name in COUNTS} == want
    drafted, accepted, hits = want.values()
    assert 0 < accepted < drafted and hits > 0, want
    m = custom["metrics"]
    assert 0 < m["chunkattn:decode_shared_kv_tokens_total"] < m["chunkattn:decode_kv_tokens_total"]
    assert m["chunkattn:chunks_in_use"] == 0, m                # every request finished
