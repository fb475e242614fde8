"""Where a benchmark result came from, for the first lines of every result file: the machine
(CPU model, AMX or not, cores, load), the git commit and the native kernel build."""
from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path


def cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def has_amx() -> bool:
    """AMX tiles with bf16 products (Intel Sapphire Rapids and later), as /proc/cpuinfo says."""
    flags = set(_cpuinfo_field("flags").split())
    return {"amx_tile", "amx_bf16"} <= flags


def load_average() -> str:
    return "%.2f / %.2f / %.2f" % os.getloadavg() if hasattr(os, "getloadavg") else "n/a"


def widest_simd() -> str:
    """The widest x86 vector extension the CPU kernels can use here, as /proc/cpuinfo says."""
    flags = set(_cpuinfo_field("flags").split())
    for flag, name in (("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2")):
        if flag in flags:
            return name
    return "no AVX2"


def machine() -> str:
    """e.g. 'AMD EPYC 9R14, AVX-512 BF16, no AMX, 2 cores, Linux x86_64'."""
    return (f"{cpu_model()}, {widest_simd()}, {'AMX' if has_amx() else 'no AMX'}, "
            f"{os.cpu_count()} cores, {platform.system()} {platform.machine()}")


def git_commit() -> str:
    """HEAD, with '+changes' when tracked files differ from it (a copy of a working tree, as the
    GPU machine gets, can carry an older HEAD than the code that ran)."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+changes" if head and git("status", "--porcelain",
                                                  "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def native_build() -> str:
    """Which CUSTOM native kernel builds ran (rebuilt often while being optimised): the setup.py
    library and the JIT one (ops/jit_build.py: the CUDA kernel on a GPU machine)."""
    import torch
    libs = sorted(Path(__file__).parents[1].glob("_C*.so"))
    libs += sorted(Path(p) for p in torch.ops.loaded_libraries if "vllm_chunkattn_jit" in p)
    if not libs:
        return "no native .so (PyTorch fallback)"
    return ", ".join(f"{p.name} built "
                     f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(p.stat().st_mtime))}"
                     for p in libs)


def _cpuinfo_field(name: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
