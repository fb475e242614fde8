"""bench router's arithmetic without servers: the workload's groups, and the per-policy numbers
summed over replicas from what each replica's /metrics says."""
from vllm_chunkattn.bench import router


def test_workload_is_groups_times_questions_shuffled_with_whole_prefixes():
    prompts = router.workload(groups=3, questions=5, prefix_words=40, question_words=6)
    assert len(prompts) == 15
    prefixes = {" ".join(p.split()[:40]) for p in prompts}
    assert len(prefixes) == 3
    assert all(len(p.split()) == 46 for p in prompts)
    first = [" ".join(p.split()[:40]) for p in prompts]
    assert first != sorted(first, key=first.index), "not shuffled: groups arrive in a block"
    assert router.workload(3, 5, 40, 6) == prompts          # seeded


def test_replica_metrics_sum_over_replicas(monkeypatch):
    pages = {
        "http://a": {"vllm:prefix_cache_hits_total": 300.0, "vllm:prefix_cache_queries_total": 400.0,
                     "chunkattn:decode_kv_tokens_total": 1000.0,
                     "chunkattn:decode_shared_kv_tokens_total": 600.0,
                     "chunkattn:chunks_in_use": 0.0, "chunkattn:chunks_cached": 10.0,
                     "vllm:request_success_total": 7.0},
        "http://b": {"vllm:prefix_cache_hits_total": 100.0, "vllm:prefix_cache_queries_total": 400.0,
                     "chunkattn:decode_kv_tokens_total": 1000.0,
                     "chunkattn:decode_shared_kv_tokens_total": 200.0,
                     "chunkattn:chunks_in_use": 2.0, "chunkattn:chunks_cached": 4.0,
                     "vllm:request_success_total": 3.0},
    }
    monkeypatch.setattr(router, "scrape", lambda url, prefixes: pages[url])

    class Replica:
        def __init__(self, url):
            self.url = url
    m = router.replica_metrics([Replica("http://a"), Replica("http://b")], block_size=16)
    assert m == {"prefix_hit_rate": 0.5, "decode_sharing": 0.4, "kv_tokens_held": 16 * 16,
                 "requests_per_replica": "7/3"}


def test_prefix_groups_name_each_prompts_group_in_arrival_order():
    prompts = router.workload(groups=3, questions=4, prefix_words=30, question_words=5)
    names = router.prefix_groups(prompts, prefix_words=30)
    assert sorted(set(names)) == ["group0", "group1", "group2"]
    assert names[0] == "group0" and names.count("group1") == 4
    for name in set(names):                          # one name: one prefix
        assert len({" ".join(p.split()[:30]) for p, n in zip(prompts, names) if n == name}) == 1
