"""ChunkAttnScheduler refuses, where it first sees the KV cache spec, what the chunk prefix tree
cannot manage; a plain full-attention model gets the tree as its KV cache manager."""
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec,
                                        KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec,
                                        UniformTypeKVCacheSpecs)
from vllm.v1.structured_output import StructuredOutputManager

from vllm_chunkattn.plugin.kv_cache_manager import ChunkTreeKVCacheManager
from vllm_chunkattn.plugin.scheduler import ChunkAttnScheduler
from vllm_runs import tiny_model

pytestmark = pytest.mark.vllm
BS = 32
SPEC = dict(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)


@pytest.fixture(scope="module")
def vllm_config():
    config = VllmConfig(model_config=ModelConfig(model=str(tiny_model()), dtype="float32"),
                        cache_config=CacheConfig(block_size=BS))
    config.cache_config.num_gpu_blocks = 64     # set by EngineCore after profiling
    return config


def scheduler(vllm_config, spec) -> ChunkAttnScheduler:
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    return ChunkAttnScheduler(vllm_config, kv_cache_config,
                              StructuredOutputManager(vllm_config), block_size=BS)


def test_full_attention_gets_the_tree(vllm_config):
    sched = scheduler(vllm_config, FullAttentionSpec(**SPEC))
    assert isinstance(sched.kv_cache_manager, ChunkTreeKVCacheManager)
    assert sched.tree.pool_size == 63


@pytest.mark.parametrize("spec", [SlidingWindowSpec(sliding_window=128, **SPEC),
                                  FullAttentionSpec(sliding_window=128, **SPEC)],
                         ids=["SlidingWindowSpec", "FullAttentionSpec-with-window"])
def test_a_single_windowed_group_gets_the_tree(spec):
    """Windowed layers in one group (every layer slides, or vLLM's unified hybrid spec): the
    tree keeps every token's KV and the kernel masks what each window does not see."""
    config = VllmConfig(model_config=ModelConfig(model=str(tiny_model()), dtype="float32",
                                                 max_model_len=2016),
                        cache_config=CacheConfig(block_size=BS))
    config.cache_config.num_gpu_blocks = 64
    sched = scheduler(config, spec)
    assert isinstance(sched.kv_cache_manager, ChunkTreeKVCacheManager)


def test_a_windowed_group_that_cannot_hold_max_model_len_is_refused(vllm_config):
    """vLLM sizes a sliding-window group for the window only; the tree needs max_model_len."""
    with pytest.raises(ValueError, match=r"KV cache holds 2016 tokens, fewer than "
                                         r"--max-model-len 8192"):
        scheduler(vllm_config, SlidingWindowSpec(sliding_window=128, **SPEC))
    # A full-attention group vLLM itself sized for max_model_len: no such check.
    scheduler(vllm_config, FullAttentionSpec(sliding_window=128, **SPEC))


def test_other_single_group_kinds_are_refused(vllm_config):
    with pytest.raises(ValueError, match="chunked_local_attention KV cache groups"):
        scheduler(vllm_config, ChunkedLocalAttentionSpec(attention_chunk_size=64, **SPEC))
    # Two precisions in one group: vLLM would zero new blocks, which the tree never reports.
    mixed = UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs={
        "layer.0": FullAttentionSpec(**SPEC),
        "layer.1": FullAttentionSpec(**{**SPEC, "dtype": torch.bfloat16})})
    with pytest.raises(ValueError, match="must be zeroed"):
        scheduler(vllm_config, mixed)


def test_auxiliary_outputs_are_refused(vllm_config, monkeypatch):
    """vLLM 0.33's --enable-return-routed-experts: its scheduler connector finds cached prefixes
    in vLLM's BlockPool, which the tree replaces. vLLM 0.32 has no such option: stood in."""
    try:
        from vllm.config import AuxOutputConfig
        aux = AuxOutputConfig(enable_return_routed_experts=True)
    except ImportError:
        aux = SimpleNamespace(enabled=True)
    monkeypatch.setattr(vllm_config, "aux_output_config", aux, raising=False)
    with pytest.raises(ValueError, match=r"does not support auxiliary outputs "
                                         r"\(--enable-return-routed-experts\)"):
        scheduler(vllm_config, FullAttentionSpec(**SPEC))
