"""plugin/stats.py without a vLLM engine: the counters' JSON files and log lines, and the
chunkattn:* values a MultiProcessCollector (what vLLM's /metrics reads) finds."""
import json
import types

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from vllm_chunkattn import envs
from vllm_chunkattn.plugin import stats
from vllm_chunkattn.tree import ChunkPrefixTree


class Lines:
    """Stands in for the plugin's logger: keeps the formatted info lines."""

    def __init__(self):
        self.lines = []

    def info(self, fmt, *args):
        self.lines.append(fmt % args)


@pytest.fixture
def lines(monkeypatch):
    got = Lines()
    monkeypatch.setattr(stats, "logger", got)
    return got.lines


def vllm_config(model="tiny", engine=0):
    """An engine's config as each data-parallel rank of a dense model holds it: vLLM resets
    data_parallel_rank to 0 there and keeps the rank in data_parallel_index."""
    return types.SimpleNamespace(model_config=types.SimpleNamespace(served_model_name=model),
                                 parallel_config=types.SimpleNamespace(data_parallel_rank=0,
                                                                       data_parallel_index=engine))


def collected(path) -> dict:
    """(sample name, engine label) -> value, as /metrics would show them."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(path))
    return {(s.name, s.labels["engine"]): s.value for m in registry.collect() for s in m.samples}


def shared_prefix_tree() -> ChunkPrefixTree:
    """Two sequences of 10 tokens sharing their first two chunks of 4."""
    tree = ChunkPrefixTree(num_blocks=9, block_size=4)
    tree.add_sequence("a", list(range(10)))
    tree.add_sequence("b", list(range(8)) + [50, 51])
    return tree


def test_sharing_counters_are_flushed_to_their_file_and_log(tmp_path, monkeypatch, lines):
    path = tmp_path / "worker.json"
    monkeypatch.setenv("CHUNKATTN_STATS_FILE", str(path))
    monkeypatch.setenv("CHUNKATTN_STATS_INTERVAL_S", "0")
    s = stats.SharingStats()
    s.record(3, 300, 120, plan_builds=1, with_prefill=False)
    s.record(2, 200, 0, plan_builds=2, with_prefill=True)
    got = json.loads(path.read_text())
    assert got == {"decode_steps": 2, "decode_rows": 5, "kv_tokens": 500, "shared_kv_tokens": 120,
                   "max_shared_kv_tokens_per_step": 120, "plan_builds": 2, "mixed_steps": 1}
    assert list(got) == list(stats.SharingStats.COUNTERS)        # the file's layout is stable
    assert got == s.as_dict()
    assert [p.name for p in tmp_path.iterdir()] == ["worker.json"]   # no temporary file left
    assert lines[-1] == ("chunkattn decode: steps=2 rows=5 kv_tokens=500 shared_kv_tokens=120 "
                         "(24.0% of decode KV reads served by shared chunks), plan builds=2")


def test_flushes_wait_for_the_interval(tmp_path, monkeypatch, lines):
    path = tmp_path / "worker.json"
    monkeypatch.setenv("CHUNKATTN_STATS_FILE", str(path))
    monkeypatch.setenv("CHUNKATTN_STATS_INTERVAL_S", "3600")
    s = stats.SharingStats()
    s.record(1, 10, 0, plan_builds=1, with_prefill=False)
    assert not path.exists() and not lines
    s.flush()
    assert json.loads(path.read_text())["decode_steps"] == 1 and len(lines) == 1


def test_no_file_without_the_knob(tmp_path, monkeypatch, lines):
    monkeypatch.delenv("CHUNKATTN_STATS_FILE", raising=False)
    monkeypatch.setenv("CHUNKATTN_STATS_INTERVAL_S", "0")
    monkeypatch.chdir(tmp_path)
    s = stats.SharingStats()
    s.record(1, 10, 0, plan_builds=1, with_prefill=False)
    assert s.path is None and not list(tmp_path.iterdir()) and len(lines) == 1


def test_tree_counters_count_each_decode_steps_sharing(tmp_path, monkeypatch, lines):
    path = tmp_path / "tree.json"
    monkeypatch.setenv("CHUNKATTN_TREE_STATS_FILE", str(path))
    monkeypatch.setenv("CHUNKATTN_STATS_INTERVAL_S", "0")
    monkeypatch.setenv("CHUNKATTN_DEBUG_TREE", "1")
    m = stats.TreeMetrics(shared_prefix_tree())
    m.on_step({"a": 1, "b": 1, "c": 7})     # "c" prefills: not a decode row
    got = json.loads(path.read_text())
    assert got == m.as_dict()
    assert (got["steps"], got["decode_steps"], got["decode_rows"]) == (1, 1, 2)
    assert got["decode_kv_tokens"] == 20
    assert got["decode_shared_kv_tokens"] == got["max_decode_shared_kv_tokens"] == 8   # 2 chunks
    assert got["live_shared_kv_tokens"] == 8 and got["in_use_blocks"] == 4
    assert (got["hit_tokens"], got["query_tokens"], got["hit_rate"]) == (8, 20, 0.4)
    assert got["invariant_checks"] == 1 and got["pool_blocks"] == 8 and got["num_live_seqs"] == 2
    assert lines[-1] == ("chunkattn tree: 2 live seqs, chunks in use=4 cached=0 free=4, KV saved "
                         "by sharing=8 tokens, prefix hit rate=40.0%, evictions=0")


def test_tree_counts_decode_sharing_only_when_asked(monkeypatch, lines):
    monkeypatch.delenv("CHUNKATTN_TREE_STATS_FILE", raising=False)
    monkeypatch.delenv("CHUNKATTN_DEBUG_TREE", raising=False)
    m = stats.TreeMetrics(shared_prefix_tree())
    m.on_step({"a": 1, "b": 1})
    assert not m.exact and m.decode_steps == 0 and m.invariant_checks == 0 and m.steps == 1


def test_values_reach_the_multiprocess_directory(tmp_path, monkeypatch, lines):
    monkeypatch.setenv("CHUNKATTN_METRICS_DIR", str(tmp_path))
    monkeypatch.setenv("CHUNKATTN_STATS_INTERVAL_S", "3600")
    tree_metrics = stats.TreeMetrics(shared_prefix_tree(), vllm_config(engine=1))
    tree_metrics.preemptions = 2
    tree_metrics.publish()
    writer = stats.MetricsWriter.for_process(vllm_config(engine=1), ("kv_tokens",
                                                                     "shared_kv_tokens"))
    writer.write({"kv_tokens": 20, "shared_kv_tokens": 8})
    got = collected(tmp_path)
    assert got[("chunkattn:decode_kv_tokens_total", "1")] == 20
    assert got[("chunkattn:decode_shared_kv_tokens_total", "1")] == 8
    assert got[("chunkattn:kv_saved_tokens", "1")] == 8
    assert got[("chunkattn:chunks_in_use", "1")] == 4
    assert got[("chunkattn:chunks_free", "1")] == 4
    assert got[("chunkattn:chunks_cached", "1")] == 0
    assert got[("chunkattn:chunk_evictions_total", "1")] == 0
    assert got[("chunkattn:preemptions_total", "1")] == 2
    assert {name for name, _ in got} == {
        stats.METRICS[k][0] + ("_total" if stats.METRICS[k][1] == "counter" else "")
        for k in stats.METRICS}


def test_no_writer_outside_a_served_config(tmp_path, monkeypatch):
    monkeypatch.delenv("CHUNKATTN_METRICS_DIR", raising=False)
    assert stats.MetricsWriter.for_process(vllm_config(), ("kv_tokens",)) is None
    monkeypatch.setenv("CHUNKATTN_METRICS_DIR", str(tmp_path))
    assert stats.MetricsWriter.for_process(None, ("kv_tokens",)) is None    # unit tests
    monkeypatch.setenv("CHUNKATTN_METRICS_DIR", str(tmp_path / "gone"))
    assert stats.MetricsWriter.for_process(vllm_config(), ("kv_tokens",)) is None


def test_expose_uses_vllms_multiprocess_directory_when_set(tmp_path, monkeypatch):
    monkeypatch.setattr(stats, "_exposed_dir", None)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setenv("CHUNKATTN_METRICS_DIR", "/inherited/from/a/parent")
    stats.expose()
    assert envs.METRICS_DIR == tmp_path
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "later"))
    stats.expose()                                        # once per process
    assert envs.METRICS_DIR == tmp_path


@pytest.mark.parametrize("path, engine, expected", [
    ("/d/stats.json", 0, "/d/stats.json"),          # rank 0, and any deployment without DP
    ("/d/stats.json", 1, "/d/stats.dp1.json"),
    ("/d/run.tree.json", 12, "/d/run.tree.dp12.json"),
    ("/d/stats", 3, "/d/stats.dp3"),
])
def test_each_data_parallel_rank_has_its_own_stats_file(path, engine, expected):
    from pathlib import Path
    assert stats.engine_file(Path(path), engine) == Path(expected)
    assert stats.engine_file(None, engine) is None


def test_tree_counters_of_a_data_parallel_rank_go_to_its_file(tmp_path, monkeypatch, lines):
    monkeypatch.setenv("CHUNKATTN_TREE_STATS_FILE", str(tmp_path / "tree.json"))
    monkeypatch.setenv("CHUNKATTN_STATS_INTERVAL_S", "0")
    stats.TreeMetrics(shared_prefix_tree(), vllm_config(engine=0)).on_step({"a": 1})
    stats.TreeMetrics(shared_prefix_tree(), vllm_config(engine=1)).on_step({"a": 1, "b": 1})
    rank0 = json.loads((tmp_path / "tree.json").read_text())
    rank1 = json.loads((tmp_path / "tree.dp1.json").read_text())
    assert (rank0["decode_rows"], rank1["decode_rows"]) == (1, 2)


def test_sharing_counters_of_a_data_parallel_rank_go_to_its_file(tmp_path, monkeypatch, lines):
    """Outside an initialized model-parallel group (this process) a worker is its engine's
    first rank: it writes the metrics and the file of its DP rank."""
    monkeypatch.setenv("CHUNKATTN_STATS_FILE", str(tmp_path / "worker.json"))
    monkeypatch.setenv("CHUNKATTN_STATS_INTERVAL_S", "0")
    monkeypatch.setenv("CHUNKATTN_METRICS_DIR", str(tmp_path))
    s = stats.SharingStats()
    s.publish_to_metrics(vllm_config(engine=1))
    s.record(2, 40, 16, plan_builds=1, with_prefill=False)
    assert not (tmp_path / "worker.json").exists()
    assert json.loads((tmp_path / "worker.dp1.json").read_text())["kv_tokens"] == 40
    got = collected(tmp_path)
    assert got[("chunkattn:decode_kv_tokens_total", "1")] == 40
    assert ("chunkattn:decode_kv_tokens_total", "0") not in got
