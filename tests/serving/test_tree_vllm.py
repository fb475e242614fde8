"""The chunk prefix tree as vLLM's KV cache manager (--attention-backend CUSTOM), on the tiny
fp32 model: token-identical to stock vLLM through preemption under a tiny KV pool, eviction,
n > 1 and reset_prefix_cache; abort mid-decode; the tree's invariants hold every step; after all
requests end every chunk is free or cached; the worker's decode plans share exactly what the
tree says is shared."""
import json
import os
import sys

import pytest

from test_vllm_equivalence import job, tree_prompts
from vllm_runs import assert_same_outputs
from vllm_runs import (REPO, assert_native_kernel, assert_not_custom, job_env, run_llm,
                       tiny_model)

pytestmark = pytest.mark.vllm
NUM_BLOCKS = 24          # 24 x 32 tokens: far less than the 8 prompts below need at once


def _tiny_pool(j: dict) -> dict:
    j["engine"].update(num_gpu_blocks_override=NUM_BLOCKS, max_model_len=512)
    greedy = j["groups"][0]
    greedy["prompts"] = greedy["prompts"][::2]
    # vLLM admits what fits now; 160 decode tokens each (5 chunks) then overflow the pool.
    greedy["sampling"] = {**greedy["sampling"], "max_tokens": 160}
    again = {**greedy, "prompts": greedy["prompts"][:3]}
    # n=4 seeded samples of a 73-token prompt (2 shared chunks) fit the pool: stock vLLM 0.32
    # on CPU fails seeded sampling resumed after a preemption ("CPU Generator does not use
    # offset"), so this group must not be preempted.
    j["groups"][1]["prompts"] = [p[:64] + p[-9:] for p in j["groups"][1]["prompts"]]
    j["groups"] += [{"reset_prefix_cache": True}, again]   # cold again after the reset
    return j


def _debug_env(tmp_path, name):
    return {"CHUNKATTN_TREE_STATS_FILE": str(tmp_path / f"{name}_tree.json"),
            "CHUNKATTN_STATS_FILE": str(tmp_path / f"{name}_worker.json"),
            "CHUNKATTN_STATS_INTERVAL_S": "0", "CHUNKATTN_DEBUG_TREE": "1"}


def _read(path):
    return json.loads(path.read_text())


def test_tree_manager_matches_stock_under_preemption_eviction_n_and_reset(tmp_path):
    prompts = tree_prompts(11)
    stock = run_llm(_tiny_pool(job(None, prompts)), tmp_path)
    prom_dir = tmp_path / "prometheus"
    prom_dir.mkdir()
    custom = run_llm(_tiny_pool(job("CUSTOM", prompts)), tmp_path,
                     env={**_debug_env(tmp_path, "c"), "PROMETHEUS_MULTIPROC_DIR": str(prom_dir)})
    assert "chunk prefix tree is the KV cache manager" in custom["log"]
    assert "chunk prefix tree is the KV cache manager" not in stock["log"]
    assert_native_kernel(custom["log"])
    assert_not_custom(stock["log"])
    assert stock["groups"][2] == custom["groups"][2] == {"reset_prefix_cache": True}
    del stock["groups"][2], custom["groups"][2]
    assert_same_outputs(stock, custom)
    tree, worker = _read(tmp_path / "c_tree.json"), _read(tmp_path / "c_worker.json")
    assert tree["preemptions"] > 0, tree                    # the pool really was too small
    assert tree["evictions"] > 0, tree
    assert tree["hit_tokens"] > 0, tree                     # system prompts and n=4 shared
    assert tree["invariant_checks"] >= tree["steps"] > 0
    # All requests ended: nothing in use, every chunk free or cached (the reset emptied the
    # cache, the last group refilled it).
    assert tree["num_live_seqs"] == tree["in_use_blocks"] == 0, tree
    assert tree["cached_blocks"] + tree["free_blocks"] == tree["pool_blocks"] == NUM_BLOCKS - 1
    # The worker's plans (built from the block tables the tree handed out) share what the tree
    # predicts, step for step summed.
    assert tree["decode_shared_kv_tokens"] == worker["shared_kv_tokens"] > 0, (tree, worker)
    # The same numbers reach Prometheus (vLLM's /metrics reads this multi-process directory).
    from prometheus_client import CollectorRegistry, multiprocess
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(prom_dir))
    prom = {m.name: m.samples[0].value for m in registry.collect()
            if m.name.startswith("chunkattn:")}
    assert prom["chunkattn:chunk_evictions"] == tree["evictions"], prom
    assert prom["chunkattn:chunks_in_use"] == 0
    assert prom["chunkattn:decode_shared_kv_tokens"] == tree["decode_shared_kv_tokens"]


@pytest.mark.parametrize("seed", range(3))
def test_manager_hits_like_stock_on_random_workloads(seed):
    """No engine: the scheduler's calls on both managers (ample pool, so no eviction) give the
    same prefix hits and block counts in use at every point; the tree's invariants hold."""
    import random
    pytest.importorskip("vllm")
    from vllm_chunkattn.bench.kv_manager_sim import Sim
    rng = random.Random(seed)
    sims = {kind: Sim(kind, 4096, 16) for kind in ("stock", "tree")}
    systems = [[rng.randrange(3, 500) for _ in range(rng.randint(10, 80))] for _ in range(4)]
    live, next_id = [], 0
    for _ in range(300):
        op = rng.random()
        if op < 0.3 or not live:
            prompt = rng.choice(systems) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))]
            rid = f"r{next_id}"
            next_id += 1
            hits = {kind: sim.admit(rid, prompt) for kind, sim in sims.items()}
            assert hits["stock"] == hits["tree"] is not None, hits
            live.append(rid)
        elif op < 0.85:
            token = rng.randrange(3, 500)
            for rid in live:
                for sim in sims.values():
                    assert sim.decode(sim.add_token(rid, token))
        else:
            rid = live.pop(rng.randrange(len(live)))
            for sim in sims.values():
                sim.finish(rid)
        assert sims["stock"].blocks_in_use() == sims["tree"].blocks_in_use()
        tree = sims["tree"].manager
        tree.tree.check_invariants()
    assert tree.tree.stats().num_hit_tokens > 0


def test_abort_mid_decode_releases_everything(tmp_path):
    out = tmp_path / "abort.json"
    env = _debug_env(tmp_path, "a")
    # Run as a script, this file imports its neighbours and tests/' helpers (vllm_runs).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"),
                                                     os.environ.get("PYTHONPATH")]))
    import subprocess
    proc = subprocess.run([sys.executable, __file__, str(tiny_model()), str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env=job_env(env))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert_native_kernel(proc.stdout + proc.stderr)
    result = _read(out)
    assert result["kept"] == [60] * 4, result                # the others ran to the end
    assert all(n is None or n < 60 for n in result["aborted"]), result
    tree = _read(tmp_path / "a_tree.json")
    assert tree["invariant_checks"] > 0
    assert tree["num_live_seqs"] == tree["in_use_blocks"] == 0, tree
    assert tree["cached_blocks"] > 0, tree                   # finished/aborted chunks stay cached
    assert tree["cached_blocks"] + tree["free_blocks"] == tree["pool_blocks"]


def _abort_child(model: str, out_path: str) -> None:
    """Drive the engine step by step; abort half the requests after a few decode steps."""
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", attention_backend="CUSTOM", block_size=32,
              max_model_len=2048, enforce_eager=True, kv_cache_memory_bytes=64 << 20, seed=0,
              max_num_seqs=16)
    engine = llm.llm_engine
    rng = random.Random(3)
    system = [rng.randint(3, 2000) for _ in range(100)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    ids = []
    for i in range(8):
        prompt = system + [rng.randint(3, 2000) for _ in range(rng.randint(5, 30))]
        ids.append(engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompt), params)
                   or f"r{i}")
    for _ in range(6):                       # prefill + a few decode steps
        engine.step()
    ids, aborted = [f"r{i}" for i in range(8)], [f"r{i}" for i in range(0, 8, 2)]
    engine.abort_request(aborted)            # external ids, as outputs carry them
    lengths = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                lengths[o.request_id] = len(o.outputs[0].token_ids)
    json.dump({"kept": sorted(lengths[r] for r in ids if r not in aborted),
               "aborted": [lengths.get(r) for r in aborted]}, open(out_path, "w"))


if __name__ == "__main__":
    _abort_child(*sys.argv[1:3])
