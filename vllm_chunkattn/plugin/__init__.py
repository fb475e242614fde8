"""The only door into vLLM: a `vllm.general_plugins` entry point that makes
`--attention-backend CUSTOM` select ChunkAttention, on GPU and on CPU.

vLLM calls register() in every process (API server, EngineCore, workers), possibly more than
once. It registers the backend class under vLLM's CUSTOM slot; without the flag nothing changes.
"""
from __future__ import annotations

import logging

BACKEND_PATH = "vllm_chunkattn.plugin.backend.ChunkAttnBackend"
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
    _registered = True


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
            raise ValueError(
                f"--attention-backend CUSTOM (ChunkAttention) cannot serve this model exactly: "
                f"{', '.join(reasons)}. Run without the flag to use vLLM's own attention.")
        return AttentionBackendEnum.CUSTOM.get_path()

    get_attn_backend_cls._chunkattn_wrapped = True
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
