"""What of the GPU serving path runs without a GPU: vLLM 0.32.0 for CUDA (the bundle) on a
stand-in of the GPU host's image, vLLM's CUDA platform forced as an H100 (import_probe.py), no
driver. Checks that --attention-backend CUSTOM selects our backend on the CUDA platform for every
block size the kernel takes (stock picks FLASH_ATTN), that the tree's async scheduler is
installed with async scheduling and FULL_AND_PIECEWISE graphs left on, and that ChunkAttnImpl and
ChunkAttnMetadataBuilder construct over FLASH_ATTN's (the builder on a CPU device, with the
PyTorch reference standing in for the kernel), and that a GPU the kernel cannot serve (an L4's
99 KB per block at head 256) is refused by vLLM's own selection with the reason, and an fp8 KV
cache with the flag where the config is built. torch has no
driver here, so the device's properties are an H100's (or the L4's) as torch would report them.
Exit 1 on any failure.

Usage (benchmarks/gpu/rehearsal.md):
  eval "$(VLLM_SITE=... bash benchmarks/gpu/offline/install_bundle.sh env)"
  CHUNKATTN_ALLOW_REFERENCE=1 python benchmarks/gpu/rehearse_cuda_glue.py
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import import_probe  # noqa: E402


def main() -> int:
    stand_in_h100()
    import torch
    from vllm.config import (AttentionConfig, CacheConfig, ModelConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import get_attn_backend
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_chunkattn.plugin import backend as be
    from vllm_chunkattn.plugin import register
    register()
    print("platform:", type(current_platform).__name__, current_platform.get_device_capability())
    failures = []
    model = os.path.join(os.path.dirname(__file__), "..", "..", "models", "tiny-llama")
    for requested, want in ((None, "FLASH_ATTN"), (AttentionBackendEnum.CUSTOM, "CUSTOM")):
        for block in (16, 32, 64):
            cfg = VllmConfig(model_config=ModelConfig(model=model, dtype="bfloat16"),
                             cache_config=CacheConfig(block_size=block),
                             attention_config=AttentionConfig(backend=requested))
            with set_current_vllm_config(cfg):
                got = get_attn_backend(head_size=128, dtype=torch.bfloat16,
                                       kv_cache_dtype="auto", num_heads=8).get_name()
            sched = cfg.scheduler_config
            line = (f"backend={requested and requested.name} block={block}: {got}, scheduler "
                    f"{sched.scheduler_cls}, async {sched.async_scheduling}, graphs "
                    f"{cfg.compilation_config.cudagraph_mode.name}")
            print(line)
            ok = got == want and sched.async_scheduling and (
                cfg.compilation_config.cudagraph_mode.name == "FULL_AND_PIECEWISE")
            if want == "CUSTOM":
                ok &= sched.scheduler_cls.endswith("ChunkAttnAsyncScheduler")
            if not ok:
                failures.append(line)
    failures += refused_where_it_cannot_serve(cfg)
    failures += refused_where_the_config_is_built(model)
    base, layout, layouts = be._platform_base()
    print("platform base:", base.get_name(), layout, layouts)
    if base.get_name() != "FLASH_ATTN" or layout != "flash":
        failures.append(f"platform base {base.get_name()} / {layout}")
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    with set_current_vllm_config(cfg):
        impl = be.ChunkAttnImpl(8, 128, 128 ** -0.5, 2, None, None, "auto")
        builder = be.ChunkAttnMetadataBuilder(spec, ["layer.0"], cfg, torch.device("cpu"))
    print("impl over", type(impl.base).__name__, "| builder over", type(builder.base).__name__)
    if type(impl.base).__name__ != "FlashAttentionImpl":
        failures.append(f"impl base {type(impl.base).__name__}")
    print("FAILED:\n  " + "\n  ".join(failures) if failures else "GLUE OK")
    return 1 if failures else 0


H100 = (*import_probe.H100, 232448)      # + cudaDevAttrMaxSharedMemoryPerBlockOptin, bytes
L4 = ((8, 9), "NVIDIA L4", 101376)


def stand_in_h100() -> None:
    """vLLM's CUDA platform and torch.cuda as on an H100, no driver: the start of main(), and
    what cuda_platform_stand_in.py (the pytest plugin) does on import."""
    import_probe._ensure_libcuda()                # re-execs with a stub driver if none loads
    import_probe._force_cuda_platform()
    stand_in_device(H100)


def stand_in_device(gpu) -> None:
    """What torch.cuda and vLLM's platform report for device 0, as on that GPU (no driver here:
    the backend's selection-time check reads the device's shared memory per block)."""
    import torch
    (major, minor), name, smem = gpu
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_properties = lambda device=None: SimpleNamespace(
        name=name, major=major, minor=minor, shared_memory_per_block_optin=smem)
    import_probe.stand_in_platform((major, minor), name)


def refused_where_it_cannot_serve(cfg) -> list[str]:
    """Head 256 on an L4 (99 KB per block): vLLM's selection must stop with the kernel's reason;
    head 128 there is served."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import _cached_get_attn_backend, get_attn_backend

    from vllm_chunkattn.ops.cuda_fit import PARTIAL_SMEM_BYTES
    failures = []
    stand_in_device(L4)
    try:
        for head_size, refused in ((128, False), (256, True)):
            _cached_get_attn_backend.cache_clear()
            try:
                with set_current_vllm_config(cfg):
                    got = get_attn_backend(head_size=head_size, dtype=torch.bfloat16,
                                           kv_cache_dtype="auto", num_heads=8).get_name()
                line, ok = f"L4 head {head_size}: {got}", not refused and got == "CUSTOM"
            except ValueError as e:
                line = f"L4 head {head_size}: refused: {' '.join(str(e).split())[:240]}"
                ok = refused and f"needs {PARTIAL_SMEM_BYTES[256]} bytes of shared memory" in str(e)
            print(line)
            if not ok:
                failures.append(line)
    finally:
        stand_in_device(H100)
        _cached_get_attn_backend.cache_clear()
    return failures


def refused_where_the_config_is_built(model) -> list[str]:
    """A quantized KV cache (an fp8 cache is common on GPUs) with CUSTOM: the config's own
    construction on the CUDA platform refuses it (plugin/support.py); stock takes it."""
    from vllm.config import AttentionConfig, CacheConfig, ModelConfig, VllmConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    failures = []
    for requested in (None, AttentionBackendEnum.CUSTOM):
        try:
            VllmConfig(model_config=ModelConfig(model=model, dtype="bfloat16"),
                       cache_config=CacheConfig(block_size=16, cache_dtype="fp8"),
                       attention_config=AttentionConfig(backend=requested))
            line, ok = f"fp8 KV cache, backend={requested and requested.name}: built", \
                requested is None
        except ValueError as e:
            line = (f"fp8 KV cache, backend={requested and requested.name}: refused: "
                    f"{' '.join(str(e).split())[:240]}")
            ok = requested is not None and "quantized KV cache (fp8)" in str(e)
        print(line)
        if not ok:
            failures.append(line)
    return failures


if __name__ == "__main__":
    sys.exit(main())
