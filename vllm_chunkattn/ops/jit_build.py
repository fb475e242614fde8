"""JIT build of csrc/ (schemas + CPU kernel + CUDA kernel) into one library that registers
torch.ops.chunkattn, cached per torch / CUDA / GPU arch / source hash. Imported only when CUDA is
present and no prebuilt vllm_chunkattn._C exists (see native.py), so a CPU-only import never needs
the CUDA toolkit."""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def _arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST if set, else the local GPU's arch ('9.0a' on Hopper: wgmma/setmaxnreg
    need the arch-specific target)."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return env
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}" + ("a" if major == 9 else "")


def _sources(csrc_dir: Path) -> list[Path]:
    return ([csrc_dir / "torch_bindings.cpp"] + sorted((csrc_dir / "cpu").glob("*.cpp"))
            + sorted((csrc_dir / "cuda").glob("*.cu")))


def build_dir(csrc_dir: Path, arch: str) -> Path:
    """$CHUNKATTN_BUILD_DIR, else ~/.cache/vllm_chunkattn/jit/<key>: a new key whenever torch,
    CUDA, the arch or any source/header changes, so a stale library is never loaded."""
    if os.environ.get("CHUNKATTN_BUILD_DIR"):
        return Path(os.environ["CHUNKATTN_BUILD_DIR"])
    h = hashlib.sha256(f"{torch.__version__}|{torch.version.cuda}|{arch}".encode())
    for f in sorted(p for p in csrc_dir.rglob("*") if p.suffix in {".cpp", ".cu", ".h", ".cuh"}):
        h.update(f.relative_to(csrc_dir).as_posix().encode())
        h.update(f.read_bytes())
    return Path.home() / ".cache" / "vllm_chunkattn" / "jit" / h.hexdigest()[:16]


def load_jit(csrc_dir, verbose: bool | None = None) -> None:
    """Builds (or reuses) and loads the library; torch.ops.chunkattn.* exist afterwards."""
    from torch.utils import cpp_extension

    csrc_dir = Path(csrc_dir)
    arch = _arch_list()
    out = build_dir(csrc_dir, arch)
    out.mkdir(parents=True, exist_ok=True)
    verbose = os.environ.get("CHUNKATTN_JIT_VERBOSE") == "1" if verbose is None else verbose
    logger.info("chunkattn: JIT-building %s for arch %s in %s", csrc_dir, arch, out)
    old = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    try:
        cpp_extension.load(
            name="vllm_chunkattn_jit",
            sources=[str(s) for s in _sources(csrc_dir)],
            extra_cflags=["-O3", "-fopenmp"],
            extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr", "-lineinfo"],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(csrc_dir)],
            build_directory=str(out),
            is_python_module=False,
            verbose=verbose,
        )
    finally:
        if old is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old
