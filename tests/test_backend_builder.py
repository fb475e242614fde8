"""ChunkAttnMetadataBuilder without a model runner (vLLM's attention-backend test shape): a real
VllmConfig of the tiny model, the platform builder underneath, builder.build called directly."""
import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_chunkattn.plugin import backend
from vllm_runs import tiny_model

pytestmark = pytest.mark.vllm
BS = 32


@pytest.fixture(scope="module")
def vllm_config():
    return VllmConfig(model_config=ModelConfig(model=str(tiny_model()), dtype="float32"),
                      cache_config=CacheConfig(block_size=BS))


def make_builder(vllm_config) -> backend.ChunkAttnMetadataBuilder:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    with set_current_vllm_config(vllm_config):
        return backend.ChunkAttnMetadataBuilder(spec, ["layer.0"], vllm_config,
                                                torch.device("cpu"))


def test_metadata_carries_the_batch_slot_mapping(vllm_config):
    """Finding 5: like every in-tree backend's metadata, ours has the step's slot_mapping."""
    builder = make_builder(vllm_config)
    # Two decodes sharing block 1 (40 tokens each), then a 5-token prefill.
    query_start_loc = torch.tensor([0, 1, 2, 7], dtype=torch.int32)
    seq_lens = torch.tensor([40, 40, 5], dtype=torch.int32)
    slot_mapping = torch.tensor([2 * BS + 7, 3 * BS + 7, 4 * BS, 4 * BS + 1, 4 * BS + 2,
                                 4 * BS + 3, 4 * BS + 4])
    cm = CommonAttentionMetadata(
        query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc, seq_lens=seq_lens,
        num_reqs=3, num_actual_tokens=7, max_query_len=5, max_seq_len=40,
        block_table_tensor=torch.tensor([[1, 2], [1, 3], [4, 0]], dtype=torch.int32),
        slot_mapping=slot_mapping, seq_lens_cpu_upper_bound=seq_lens.clone())
    with set_current_vllm_config(vllm_config):
        md = builder.build(0, cm)
    assert md.num_decodes == 2 and md.prefill is not None
    assert torch.equal(md.slot_mapping, torch.tensor([71, 103, 128, 129, 130, 131, 132]))


def test_missing_native_kernel_is_a_startup_error_unless_opted_in(vllm_config, monkeypatch):
    """No silent slow path: without the native kernel for the device, building the backend fails
    and names the fix; CHUNKATTN_ALLOW_REFERENCE=1 opts in to the PyTorch reference."""
    assert backend.kernel_name(torch.device("cpu")) == "native-cpu"    # this checkout's build
    monkeypatch.setattr(backend, "_announced", False)
    make_builder(vllm_config)                                          # the real kernel: starts
    monkeypatch.setattr(backend, "_announced", False)
    monkeypatch.setattr(backend, "kernel_name", lambda device: "torch-reference")
    monkeypatch.delenv("CHUNKATTN_ALLOW_REFERENCE", raising=False)
    with pytest.raises(RuntimeError) as err:
        make_builder(vllm_config)
    message = str(err.value)
    assert "pip install -e . --no-build-isolation" in message
    assert "CHUNKATTN_ALLOW_REFERENCE=1" in message
    monkeypatch.setenv("CHUNKATTN_ALLOW_REFERENCE", "1")
    assert make_builder(vllm_config).block_size == BS
