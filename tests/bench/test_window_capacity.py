"""bench capacity: stock's hybrid KV cache manager and the tree in the same groups hold the same
requests in the same memory; with full-length windowed layers the tree holds fewer."""
import pytest

pytest.importorskip("vllm")

from vllm_chunkattn.bench.window_capacity import kv_cache_config, requests_held

pytestmark = pytest.mark.vllm
MEMORY = 1 << 28                     # 256 MiB of bf16 KV


def prompts(shared: int, length: int = 2048):
    return ([3 + k % 97 for k in range(shared)]
            + [3 + (n * 7919 + k) % 30011 for k in range(length - shared)] for n in range(512))


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gemma-3-1b"])
@pytest.mark.parametrize("shared", [0, 512])
def test_the_tree_holds_what_stocks_hybrid_manager_holds(name, shared):
    held = {variant: requests_held(variant, name, 16, MEMORY, prompts(shared), 512, 128)[0]
            for variant in ("stock", "tree", "tree, full-length")}
    assert held["stock"] >= 2, held
    assert held["tree"] >= held["stock"], held
    assert held["tree, full-length"] < held["tree"], held


def test_vllm_groups_the_layouts_as_the_models_serve():
    full_length = kv_cache_config("gpt-oss-20b", 16, MEMORY, hybrid=False)
    hybrid = kv_cache_config("gpt-oss-20b", 16, MEMORY, hybrid=True)
    assert len(full_length.kv_cache_groups) == 1
    assert len(hybrid.kv_cache_groups) == 2            # blocks of half the layers: twice as many
    assert abs(hybrid.num_blocks - 2 * full_length.num_blocks) <= 1
    kinds = sorted(type(g.kv_cache_spec).__name__ for g in hybrid.kv_cache_groups)
    assert kinds == ["FullAttentionSpec", "SlidingWindowSpec"]
    gemma = kv_cache_config("gemma-3-1b", 16, MEMORY, hybrid=True)
    assert len(gemma.kv_cache_groups) > 2      # one full group, several windowed ones
