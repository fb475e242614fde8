"""--data-parallel-size 2 on CPU, served: CUSTOM is token-identical to stock DP=2 on the tiny fp32
model, both ranks ran the native TPP kernel, and each rank's sharing counters are its own: on
/metrics under the rank's `engine` label (the label of vLLM's own series of that engine), and in
per-rank stats files (rank 0: the path, rank 1: `.dp1` before the suffix).

Each DP rank of a dense model is an independent engine (EngineCore, scheduler, tree, worker);
vLLM runs them from `vllm serve` only (LLM(data_parallel_size=2) is refused for dense models),
so both sides are servers. Requests are pinned to a rank with vLLM's X-data-parallel-rank
header, and the two ranks get different loads. The oracle for each rank's decode KV tokens:
prompts fit one step's token budget (no chunked prefill), and a greedy ignore_eos request of P
prompt tokens and M outputs has M - 1 decode steps reading P + 1, ..., P + M - 1 tokens.
VLLM_CPU_OMP_THREADS_BIND="0|1" gives each rank a core of its own."""
import json
import os
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_runs import assert_native_kernel, assert_not_custom, decode_kv_tokens, tiny_model

DP = 2
CORES = sorted(os.sched_getaffinity(0))
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(len(CORES) < DP, reason="one core per DP rank")]
pytest.importorskip("vllm")

from vllm_chunkattn.bench.server_process import ServerProcess  # noqa: E402

MAX_TOKENS = 12
FLAGS = ["--served-model-name", "tiny", "--dtype", "float32", "--block-size", "32",
         "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20), "--enforce-eager",
         "--max-num-batched-tokens", "2048", "--seed", "0", "--data-parallel-size", str(DP)]
VOCAB = range(3, 2048)   # skip <unk>, <s>, </s>


def rank_prompts() -> dict[int, list[list[int]]]:
    """Per rank, questions on one system prompt (3 chunks of 32 and more): rank 0 four
    requests, rank 1 two with a longer prefix, so the ranks' counts differ."""
    rng = random.Random(11)

    def words(n):
        return [rng.choice(VOCAB) for _ in range(n)]
    systems = {0: words(100), 1: words(170)}
    return {rank: [systems[rank] + words(rng.randint(5, 30)) for _ in range(4 if rank == 0 else 2)]
            for rank in range(DP)}


def complete(server, prompt: list[int], rank: int) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_token_ids": True}
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json",
                                  "X-data-parallel-rank": str(rank)})
    with urllib.request.urlopen(req, timeout=300) as r:
        choice = json.loads(r.read())["choices"][0]
    return {"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}


def serve_load(server) -> dict[int, list[dict]]:
    """Every rank's requests at once (each rank's decode together), pinned to their rank."""
    jobs = [(rank, p) for rank, prompts in rank_prompts().items() for p in prompts]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: complete(server, job[1], job[0]), jobs))
    by_rank: dict[int, list[dict]] = {rank: [] for rank in range(DP)}
    for (rank, _), out in zip(jobs, outs):
        by_rank[rank].append(out)
    return by_rank


def scrape(server) -> dict[tuple[str, str], float]:
    """(sample name, engine label) -> value, summed over other labels."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, s.labels.get("engine", ""))
            values[key] = values.get(key, 0.0) + s.value
    return values


def env() -> dict:
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in CORES[:DP])}


@pytest.fixture(scope="module")
def stock_outputs(tmp_path_factory):
    log = tmp_path_factory.mktemp("stock") / "server.log"
    with ServerProcess(str(tiny_model()), FLAGS, env=env(), log_path=log) as server:
        outputs = serve_load(server)
    assert_not_custom(log.read_text())
    return outputs


@pytest.fixture(scope="module")
def custom(tmp_path_factory):
    """The CUSTOM DP=2 server after the load: its outputs, /metrics and stats files."""
    d = tmp_path_factory.mktemp("custom")
    files = {"stats": d / "stats.json", "tree": d / "tree.json"}
    server = ServerProcess(str(tiny_model()), FLAGS + ["--attention-backend", "CUSTOM"],
                           env={**env(), "CHUNKATTN_STATS_FILE": str(files["stats"]),
                                "CHUNKATTN_TREE_STATS_FILE": str(files["tree"]),
                                "CHUNKATTN_STATS_INTERVAL_S": "0"},
                           log_path=d / "server.log")
    for name in ("PROMETHEUS_MULTIPROC_DIR", "CHUNKATTN_METRICS_DIR"):
        server.env.pop(name, None)            # /metrics must need no environment at all
    with server:
        outputs = serve_load(server)
        metrics = settled_metrics(server)
    return {"outputs": outputs, "metrics": metrics, "files": files, "dir": d,
            "log": (d / "server.log").read_text()}


def settled_metrics(server, timeout_s: float = 20) -> dict:
    """/metrics once every rank's KV usage is back to 0 (vLLM's stats follow the last step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(server)
        usage = [m.get(("vllm:kv_cache_usage_perc", str(r))) for r in range(DP)]
        if all(u == 0 for u in usage) or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def test_dp2_custom_matches_stock(stock_outputs, custom):
    assert_native_kernel(custom["log"], ranks=DP)
    for rank in range(DP):
        stock, ours = stock_outputs[rank], custom["outputs"][rank]
        assert len(stock) == len(ours) == len(rank_prompts()[rank])
        for i, (a, b) in enumerate(zip(stock, ours)):
            assert len(a["token_ids"]) == MAX_TOKENS
            assert a["token_ids"] == b["token_ids"], f"rank {rank} request {i}: tokens differ"
            diff = max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"]))
            assert diff <= 1e-3, f"rank {rank} request {i}: logprob differs by {diff}"


def test_each_rank_has_its_own_metrics_under_vllms_engine_label(custom):
    m, prompts = custom["metrics"], rank_prompts()
    engines = {e for name, e in m if name == "chunkattn:decode_shared_kv_tokens_total"}
    assert engines == {str(r) for r in range(DP)}, engines
    for rank in range(DP):
        e = str(rank)
        # The label is vLLM's own for this engine: its generation tokens are this rank's load.
        assert m[("vllm:generation_tokens_total", e)] == MAX_TOKENS * len(prompts[rank]), m
        expected = decode_kv_tokens(prompts[rank], MAX_TOKENS)
        assert m[("chunkattn:decode_kv_tokens_total", e)] == expected, m
        shared = m[("chunkattn:decode_shared_kv_tokens_total", e)]
        assert 0 < shared < m[("chunkattn:decode_kv_tokens_total", e)], m
        # Every request has finished: nothing in use on any rank, the prompts stay cached.
        assert m[("vllm:kv_cache_usage_perc", e)] == 0, m
        assert m[("chunkattn:chunks_in_use", e)] == m[("chunkattn:kv_saved_tokens", e)] == 0, m
        assert m[("chunkattn:chunks_cached", e)] > 0, m


def test_each_rank_writes_its_own_stats_files(custom):
    files, d, m, prompts = custom["files"], custom["dir"], custom["metrics"], rank_prompts()
    per_rank = {"stats": [files["stats"], d / "stats.dp1.json"],
                "tree": [files["tree"], d / "tree.dp1.json"]}
    assert sorted(p.name for p in d.glob("*.json")) == sorted(
        p.name for paths in per_rank.values() for p in paths)
    worker = [json.loads(p.read_text()) for p in per_rank["stats"]]
    tree = [json.loads(p.read_text()) for p in per_rank["tree"]]
    assert worker[0] != worker[1] and tree[0] != tree[1]
    for rank in range(DP):
        expected = decode_kv_tokens(prompts[rank], MAX_TOKENS)
        assert worker[rank]["kv_tokens"] == tree[rank]["decode_kv_tokens"] == expected, (
            rank, worker, tree)
        assert worker[rank]["decode_rows"] == len(prompts[rank]) * (MAX_TOKENS - 1), worker
        assert (worker[rank]["shared_kv_tokens"] == tree[rank]["decode_shared_kv_tokens"]
                == m[("chunkattn:decode_shared_kv_tokens_total", str(rank))]), (worker, tree, m)
        assert tree[rank]["in_use_blocks"] == tree[rank]["num_live_seqs"] == 0, tree
