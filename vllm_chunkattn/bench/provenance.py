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


def machine() -> str:
    """e.g. 'AMD EPYC 9R14, no AMX, 2 cores, Linux x86_64'."""
    return (f"{cpu_model()}, {'AMX' if has_amx() else 'no AMX'}, {os.cpu_count()} cores, "
            f"{platform.system()} {platform.machine()}")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def native_build() -> str:
    """Which CUSTOM native kernel build ran (it is rebuilt often while being optimised)."""
    sos = sorted(Path(__file__).parents[1].glob("_C*.so"))
    if not sos:
        return "no native .so (PyTorch fallback)"
    built = time.strftime("%Y-%m-%d %H:%M", time.localtime(sos[0].stat().st_mtime))
    return f"{sos[0].name} built {built}"


def _cpuinfo_field(name: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
