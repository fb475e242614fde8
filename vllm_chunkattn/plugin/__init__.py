"""The only door into vLLM: a `vllm.general_plugins` entry point that makes
`--attention-backend CUSTOM` select ChunkAttention, on GPU and on CPU.

vLLM calls register() in every process (API server, EngineCore, workers), possibly more than
once. It registers the backend class under vLLM's CUSTOM slot; without the flag nothing changes.
"""
from __future__ import annotations

import logging

from .. import envs

BACKEND_PATH = "vllm_chunkattn.plugin.backend.ChunkAttnBackend"
SCHEDULER_PATH = "vllm_chunkattn.plugin.scheduler.ChunkAttnScheduler"
ASYNC_SCHEDULER_PATH = "vllm_chunkattn.plugin.scheduler.ChunkAttnAsyncScheduler"
# A child of vLLM's logger: our lines get vLLM's format and honour its logging config.
logger = logging.getLogger("vllm.chunkattn")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    _honour_custom_backend_on_cpu()
    _use_tree_scheduler_with_custom_backend()
    _find_host_block_tables()
    _registered = True


def _find_host_block_tables() -> None:
    """On GPU the builder plans from the host rows of the block table, which vLLM keeps inside
    its model runners: note where as they are made (plugin/host_block_table.py). register() runs
    in every worker before its runner exists. On CPU too: there the V2 runner (vLLM's choice
    where Triton runs) goes the GPU's way and a test can check it (CHUNKATTN_CHECK_HOST_ROWS);
    the V1 CPU runner's table is its host buffer, which the builder reads directly."""
    from .host_block_table import install
    install()


def _honour_custom_backend_on_cpu() -> None:
    """vLLM 0.32's CpuPlatform.get_attn_backend_cls ignores the requested backend and always
    returns CPU_ATTN. This wrapper lets an explicit CUSTOM through (after the same validation the
    CUDA platform applies) and leaves every other choice to vLLM."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    original = CpuPlatform.get_attn_backend_cls
    if getattr(original, "_chunkattn_wrapped", False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if selected_backend != AttentionBackendEnum.CUSTOM:
            return original.__func__(cls, selected_backend, attn_selector_config, num_heads)
        backend_cls = AttentionBackendEnum.CUSTOM.get_class()
        reasons = backend_cls.validate_configuration(
            device_capability=None, **attn_selector_config._asdict())
        if reasons:
            from .support import refusal
            raise refusal(reasons)
        return AttentionBackendEnum.CUSTOM.get_path()

    get_attn_backend_cls._chunkattn_wrapped = True
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def _use_tree_scheduler_with_custom_backend() -> None:
    """With --attention-backend CUSTOM alone, the chunk prefix tree becomes the KV cache manager
    (plugin/scheduler.py). The platform's check_and_update_config is where vLLM itself settles
    scheduler options (VllmConfig.__post_init__ picks its diffusion scheduler right after it);
    it runs in the process that builds the config, which then ships it to EngineCore. Async
    scheduling stays as vLLM set it (on by default on GPU): the tree's async scheduler class.
    That process is also the API server, whose /metrics then shows ours (plugin/stats.py).
    What the config alone shows we cannot serve is refused here, before any engine starts."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    platform_cls = type(current_platform)
    original = platform_cls.check_and_update_config
    if getattr(original, "_chunkattn_wrapped", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        original.__func__(cls, vllm_config)
        attention = getattr(vllm_config, "attention_config", None)
        if attention is None or attention.backend != AttentionBackendEnum.CUSTOM:
            return
        from . import support
        if reasons := support.config_refusals(vllm_config, current_platform.is_cpu()):
            raise support.refusal(reasons)
        from .stats import expose
        expose()
        if not envs.TREE_KV_MANAGER:   # A/B: vLLM's manager
            return
        sched = vllm_config.scheduler_config
        if sched.scheduler_cls not in (None, SCHEDULER_PATH, ASYNC_SCHEDULER_PATH):
            logger.warning("--scheduler-cls %s given: the chunk prefix tree is not the KV cache "
                           "manager (vLLM's block-hash prefix cache is)", sched.scheduler_cls)
            return
        if reasons := support.tree_config_refusals(vllm_config):
            raise support.tree_refusal(reasons)
        if (support.has_sliding_layers(vllm_config)
                and not support.window_groups_served(vllm_config)):
            # Windowed and full layers in one KV cache group, as vLLM's own
            # --disable-hybrid-kv-cache-manager makes it (resolved after this hook).
            if sched.disable_hybrid_kv_cache_manager is False:
                raise support.tree_refusal(["the hybrid KV cache manager "
                                            "(--no-disable-hybrid-kv-cache-manager)"])
            sched.disable_hybrid_kv_cache_manager = True
        sched.scheduler_cls = ASYNC_SCHEDULER_PATH if sched.async_scheduling else SCHEDULER_PATH

    check_and_update_config._chunkattn_wrapped = True
    platform_cls.check_and_update_config = classmethod(check_and_update_config)
