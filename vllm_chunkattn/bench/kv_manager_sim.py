"""Drive vLLM's KV cache managers without a model (bench sched, tests): the stock
`KVCacheManager` (prefix caching on or off) and `ChunkTreeKVCacheManager`, through the calls the
scheduler makes: get_computed_blocks + allocate_slots on admission, allocate_slots(request, 1)
per decode token, free at the end."""
from __future__ import annotations

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

from ..plugin.kv_cache_manager import ChunkTreeKVCacheManager

KINDS = ("stock_nocache", "stock", "tree")


def make_manager(kind: str, num_blocks: int, block_size: int, max_model_len: int = 1 << 16,
                 config: KVCacheConfig | None = None):
    """config: the KV cache layout (default: one full-attention group of num_blocks)."""
    if config is None:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64,
                                 dtype=torch.float32)
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    stock = KVCacheManager(kv_cache_config=config, max_model_len=max_model_len,
                           scheduler_block_size=block_size, hash_block_size=block_size,
                           enable_caching=kind != "stock_nocache", log_stats=True)
    return ChunkTreeKVCacheManager(stock, block_size) if kind == "tree" else stock


class Sim:
    """One manager and its requests; requests carry vLLM's block hasher like EngineCore's."""

    def __init__(self, kind: str, num_blocks: int, block_size: int,
                 config: KVCacheConfig | None = None):
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(block_size, hash_fn)
        self.manager = make_manager(kind, num_blocks, block_size, config=config)
        self.requests: dict[str, Request] = {}

    def admit(self, request_id: str, prompt: list[int]) -> int | None:
        """Admit with the whole prompt in one chunk; returns the prefix-hit tokens (None: full)."""
        req = Request(request_id, list(prompt), SamplingParams(max_tokens=1 << 20), None,
                      block_hasher=self.hasher)
        blocks, num_hit, _ = self.manager.get_computed_blocks(req)
        new = self.manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, blocks)
        if new is None:
            return None
        req.num_computed_tokens = req.num_tokens
        req.status = RequestStatus.RUNNING
        self.requests[request_id] = req
        return num_hit

    def add_token(self, request_id: str, token: int) -> Request:
        """The sampled token arrives (update_from_output): outside the manager's step time."""
        req = self.requests[request_id]
        req.append_output_token_ids(token)
        return req

    def decode(self, req: Request) -> bool:
        """The manager's share of one scheduler step for one running request."""
        if self.manager.allocate_slots(req, 1) is None:
            return False
        req.num_computed_tokens += 1
        return True

    def finish(self, request_id: str) -> None:
        self.manager.free(self.requests.pop(request_id))

    def blocks_in_use(self) -> int:
        m = self.manager
        if isinstance(m, ChunkTreeKVCacheManager):
            return m.tree.stats().num_in_use_blocks
        return m.block_pool.num_gpu_blocks - 1 - m.block_pool.get_num_free_blocks()
