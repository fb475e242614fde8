"""KV cache events end to end: vLLM's LLM on the tiny model with `kv_events_config` (vLLM's ZMQ
publisher on loopback), stock and CUSTOM on the same requests; the events are read back over
ZMQ. CUSTOM publishes the blocks stock does, under the same hashes, parents first, and the
removal and clear events a consumer needs; the TPP kernel decoded."""
import pytest

from vllm_chunkattn.bench.server_process import free_port
from vllm_runs import (assert_native_kernel, assert_not_custom, assert_same_outputs, run_llm,
                       tiny_model)

pytestmark = pytest.mark.vllm
BS = 32          # CPU_ATTN (stock) needs a multiple of 32


def job(attention_backend: str | None, num_gpu_blocks: int | None = None) -> dict:
    pub, replay = free_port(), free_port()
    engine = dict(model=str(tiny_model()), dtype="float32", block_size=BS, max_model_len=1024,
                  enable_prefix_caching=True, seed=0, kv_cache_memory_bytes=64 << 20,
                  kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                    "endpoint": f"tcp://*:{pub}",
                                    "replay_endpoint": f"tcp://*:{replay}"})
    if attention_backend:
        engine["attention_backend"] = attention_backend
    if num_gpu_blocks:
        engine.update(num_gpu_blocks_override=num_gpu_blocks, max_model_len=160)
    system = [3 + (7 * k) % 900 for k in range(3 * BS + 4)]
    greedy = {"max_tokens": 24, "temperature": 0.0, "logprobs": 1, "ignore_eos": True}
    groups = [{"prompts": [system + [10 + i] * (5 + 9 * i) for i in range(4)],
               "sampling": greedy},
              {"prompts": [system + [50] * 30, [7] * (2 * BS + 3)], "sampling": greedy},
              {"reset_prefix_cache": True},
              {"prompts": [[9] * (BS + 5)], "sampling": greedy}]     # its step publishes the clear
    return {"engine": engine, "groups": groups,
            "kv_events_replay": f"tcp://127.0.0.1:{replay}"}


def events_of(result) -> list:
    return [e for batch in result["kv_events"] for e in batch["events"]]


def check_consumer_view(events) -> set:
    """What an indexer holds after the events; fails on a store whose parent it never saw."""
    held = set()
    for kind, *rest in events:
        if kind == "stored":
            hashes, parent = rest[0], rest[1]
            assert parent is None or parent in held, "parent never announced"
            held.update(hashes)
        elif kind == "removed":
            assert set(rest[0]) <= held
            held.difference_update(rest[0])
        else:
            held.clear()
    return held


def test_custom_publishes_stocks_kv_events_over_zmq(tmp_path):
    stock = run_llm(job(None), tmp_path, env={"CHUNKATTN_PREFIX_AWARE_SCHEDULING": "0"})
    custom = run_llm(job("CUSTOM"), tmp_path, env={"CHUNKATTN_PREFIX_AWARE_SCHEDULING": "0"})
    assert_not_custom(stock["log"])
    assert_native_kernel(custom["log"])
    assert custom["groups"][2] == stock["groups"][2] == {"reset_prefix_cache": True}
    del custom["groups"][2], stock["groups"][2]
    assert_same_outputs(stock, custom)
    s_events, c_events = events_of(stock), events_of(custom)
    stored = [e for e in c_events if e[0] == "stored"]
    assert len(stored) >= 6 and sum(len(e[1]) for e in stored) >= 8
    assert all(e[4] == BS and e[6] == "full_attention" and len(e[3]) == BS * len(e[1])
               for e in stored)
    assert c_events == s_events
    cleared = c_events.index(["cleared"])
    assert check_consumer_view(c_events[:cleared]) and not check_consumer_view(c_events[:cleared + 1])
    assert len(check_consumer_view(c_events)) == 1          # the last prompt's one full block


def test_evictions_reach_the_consumer_over_zmq(tmp_path):
    """A pool of 8 blocks: chunks are evicted to admit later prompts; the consumer's view stays
    consistent (every removal of a held block, every parent announced first)."""
    custom = run_llm(job("CUSTOM", num_gpu_blocks=8), tmp_path)
    assert_native_kernel(custom["log"])
    events = events_of(custom)
    assert any(e[0] == "removed" for e in events)
    check_consumer_view(events)
    assert all(batch["rank"] == 0 for batch in custom["kv_events"])
