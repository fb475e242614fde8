"""Loads the native TPP kernels (torch.ops.chunkattn) once: the extension built at install time
(vllm_chunkattn._C), or a JIT build of csrc/ when CUDA is present and nothing was built."""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np
import torch

from .. import envs
from ..plan.tpp_plan import TppPlan

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).resolve().parents[2] / "csrc"


@functools.cache
def _load() -> bool:
    try:
        from .. import _C  # noqa: F401  registers torch.ops.chunkattn.*
        _register_fake()
        return True
    except ImportError:
        pass
    if torch.cuda.is_available() and _CSRC.is_dir() and envs.JIT:
        from .jit_build import load_jit
        load_jit(_CSRC)
        _register_fake()
        return True
    return False


def _register_fake() -> None:
    """Meta impl for torch.compile / opcheck: tpp_decode only mutates its arguments, returns ().
    Called from the cached _load, so it runs at most once per process."""
    if not hasattr(torch.ops.chunkattn, "tpp_decode"):
        return

    @torch.library.register_fake("chunkattn::tpp_decode")
    def _(*args):                  # the arguments are the schema's (csrc/tpp_schema.h)
        return None


def native_ops(device: torch.device):
    """torch.ops.chunkattn if a kernel for this device type is registered, else None."""
    return _native_ops_for(device.type if isinstance(device, torch.device) else
                           torch.device(device).type)


@functools.cache
def _native_ops_for(device_type: str):
    # Once per device type: the library loads once (_load), and the builder asks every step.
    if not _load() or not hasattr(torch.ops.chunkattn, "tpp_decode"):
        return None
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None or not torch._C._dispatch_has_kernel_for_dispatch_key(
            "chunkattn::tpp_decode", key):
        return None
    return torch.ops.chunkattn


def check_plan(plan: TppPlan, block_table, seq_lens, block_size: int,
               num_blocks: int | None = None) -> None:
    """Raises what tpp_decode would raise for this plan (csrc/tpp_checks.h, same messages), on
    host tensors: the CUDA op checks only shapes, so the builder checks the host plan here once
    per step, before the copy to the device. num_blocks: KV cache blocks (None: unknown, block
    ids are then only checked to be >= 0). No-op when the native library is not built.

    plan: a TppPlan on the CPU; block_table, seq_lens: host arrays/tensors of its rows."""
    if not _load() or not hasattr(torch.ops.chunkattn, "tpp_check_plan"):
        return
    torch.ops.chunkattn.tpp_check_plan(
        _host_int32(block_table), _host_int32(seq_lens), *plan.tensors(),
        _INT32_MAX if num_blocks is None else num_blocks, block_size)


_INT32_MAX = 2 ** 31 - 1


def _host_int32(a) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        assert a.device.type == "cpu", "check_plan reads host tensors only"
        return a if a.dtype == torch.int32 else a.to(torch.int32)
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))


def kernel_name(device: torch.device | str) -> str:
    """What tpp_decode runs on this device: for the start-up log line."""
    dev = torch.device(device)
    return f"native-{dev.type}" if native_ops(dev) is not None else "torch-reference"


# Head sizes of the bf16 kernels (csrc/cpu: attend_avx512_bf16, attend_amx) that CPU_ATTN's AMX
# layout can hold (multiples of 32).
AMX_LAYOUT_HEAD_SIZES = {"": (64, 96, 128, 256), "avx512_bf16": (64, 96, 128, 256),
                         "amx": (64, 128, 256)}


def reads_cpu_attn_amx_layout(head_size: int, kv_cache_dtype: torch.dtype) -> bool:
    """Whether this machine's native CPU kernel reads CPU_ATTN's AMX cache layout in place (then
    CPU_ATTN keeps its AMX kernels for prefill and its AMX cache writes): bf16 cache, a bf16
    kernel this CPU runs (CHUNKATTN_CPU_ISA unset or amx / avx512_bf16), a head size it holds."""
    return (native_ops(torch.device("cpu")) is not None and kv_cache_dtype == torch.bfloat16
            and head_size in AMX_LAYOUT_HEAD_SIZES.get(envs.CPU_ISA, ())
            and bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()))


def cpu_kv_layout(cpu_attn_isa: str, head_size: int, kv_cache_dtype: torch.dtype) -> str:
    """The kv_layout name of a CPU cache CPU_ATTN fills with its kernels of `cpu_attn_isa`: its AMX
    layout where our kernel reads it in place, else its portable one ("cpu_attn"). Where it is
    "amx" and ours cannot read it, the plugin switches CPU_ATTN to "vec" (plugin/backend.py)."""
    return ("cpu_attn_amx" if cpu_attn_isa == "amx"
            and reads_cpu_attn_amx_layout(head_size, kv_cache_dtype) else "cpu_attn")
