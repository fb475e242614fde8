"""JIT build of csrc/ (schemas + CPU kernel + CUDA kernel) into one library that registers
torch.ops.chunkattn, cached per torch / CUDA / GPU arch / source hash. Imported only when CUDA is
present and no prebuilt vllm_chunkattn._C exists (see native.py), so a CPU-only import never needs
the CUDA toolkit."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .. import envs
from .cuda_fit import MIN_CAPABILITY, NEEDS_CAPABILITY

logger = logging.getLogger(__name__)


def arch_list() -> list[str]:
    """The archs to build: TORCH_CUDA_ARCH_LIST if set ('8.0;9.0a'), else the local GPU's.
    Hopper builds sm_90a (the arch-specific target of the machine). Anything below sm_80 is a
    clear error here rather than an nvcc failure on the kernel's PTX."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        archs = [a.strip().removesuffix("+PTX") for a in env.replace(",", ";").replace(" ", ";")
                 .split(";") if a.strip()]
    else:
        major, minor = torch.cuda.get_device_capability()
        archs = [f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else "")]
    for a in archs:
        major, minor = (int(x) for x in a.rstrip("a").split("."))
        if (major, minor) < MIN_CAPABILITY:
            raise RuntimeError(
                f"vllm-chunkattn: the CUDA TPP kernel needs {NEEDS_CAPABILITY}, but is asked to "
                f"build for {a}"
                + (" (TORCH_CUDA_ARCH_LIST)" if env else f" ({torch.cuda.get_device_name()})")
                + ". Use kernel='reference' (CHUNKATTN_ALLOW_REFERENCE=1 under vLLM) on this GPU.")
    return archs


def gencode_flags(archs: list[str]) -> list[str]:
    """Explicit -gencode per arch: torch then adds none of its own (cpp_extension skips its arch
    list once a flag names an arch)."""
    flags = []
    for a in archs:
        cc = a.replace(".", "")
        flags += ["-gencode", f"arch=compute_{cc},code=sm_{cc}"]
    return flags


def _sources(csrc_dir: Path) -> list[Path]:
    return (sorted(csrc_dir.glob("*.cpp")) + sorted((csrc_dir / "cpu").glob("*.cpp"))
            + sorted((csrc_dir / "cuda").glob("*.cu")))


def build_dir(csrc_dir: Path, arch: str) -> Path:
    """<root>/<key>, root $CHUNKATTN_BUILD_DIR or ~/.cache/vllm_chunkattn/jit: a new key whenever
    torch, CUDA, the arch (and extra flags) or any source/header changes, so a stale library is
    never loaded and two torch versions on one machine (the device image's and the vLLM
    bundle's) keep their own builds instead of rebuilding each other's."""
    root = envs.BUILD_DIR
    h = hashlib.sha256(f"{torch.__version__}|{torch.version.cuda}|{arch}".encode())
    for f in _source_tree(csrc_dir):
        h.update(f.relative_to(csrc_dir).as_posix().encode())
        h.update(f.read_bytes())
    return root / h.hexdigest()[:16]


def _source_tree(csrc_dir: Path) -> list[Path]:
    """Every file a build of csrc_dir can read: what build_dir hashes and _staged copies."""
    return sorted(p for p in csrc_dir.rglob("*") if p.suffix in {".cpp", ".cu", ".h", ".cuh"})


def _staged(csrc_dir: Path, out: Path) -> Path:
    """csrc_dir copied into the build dir its content names, once. torch writes absolute source
    and include paths into build.ninja, so building a checkout's own files rebuilds everything
    whenever the checkout is somewhere else (a second clone, the device script's snapshot of the
    tree); the copy's paths depend on the content alone."""
    staged = out / "csrc"
    if not staged.is_dir():
        tmp = Path(tempfile.mkdtemp(dir=out, prefix=".csrc-"))
        for f in _source_tree(csrc_dir):
            dst = tmp / f.relative_to(csrc_dir)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
        try:
            tmp.rename(staged)
        except OSError:                        # another process staged the same content first
            shutil.rmtree(tmp, ignore_errors=True)
    return staged


def _has_cudart(home: str | None) -> bool:
    return bool(home) and any((Path(home) / d / "libcudart.so").exists() for d in ("lib64", "lib"))


def nvcc_toolkit_root() -> str | None:
    """Where nvcc itself says its toolkit lives (the TOP of its --dryrun), or None."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        r = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in (r.stdout + r.stderr).splitlines():
        if line.startswith("#$ TOP="):
            return str(Path(line.removeprefix("#$ TOP=").strip()).resolve())
    return None


def fix_cuda_home(cpp_extension) -> None:
    """torch guesses CUDA_HOME from `which nvcc`. A wrapper script on PATH (/usr/local/bin/nvcc
    exec'ing the toolkit's, as on this project's CPU machines) makes that /usr/local, and the link
    then fails with "cannot find -lcudart". When the guess holds no CUDA runtime and the user
    set neither CUDA_HOME nor CUDA_PATH, take the toolkit root nvcc reports."""
    if (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
            or _has_cudart(cpp_extension.CUDA_HOME)):
        return
    root = nvcc_toolkit_root()
    if _has_cudart(root):
        logger.info("chunkattn: CUDA_HOME %s has no libcudart; using nvcc's toolkit %s",
                    cpp_extension.CUDA_HOME, root)
        cpp_extension.CUDA_HOME = root


def load_jit(csrc_dir, verbose: bool | None = None) -> None:
    """Builds (or reuses) and loads the library; torch.ops.chunkattn.* exist afterwards."""
    from torch.utils import cpp_extension

    fix_cuda_home(cpp_extension)
    csrc_dir = Path(csrc_dir)
    archs = arch_list()
    extra = envs.NVCC_FLAGS.split()   # e.g. -Xptxas=-v (benchmarks/gpu/run_on_device.sh)
    verbose = envs.JIT_VERBOSE if verbose is None else verbose
    _load(csrc_dir, "vllm_chunkattn_jit", _sources(csrc_dir), " ".join([";".join(archs), *extra]),
          verbose,
          extra_cflags=["-O3", "-fopenmp"],
          extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr", "-lineinfo",
                             *gencode_flags(archs), *extra],
          extra_ldflags=["-fopenmp"])


def _load(csrc_dir: Path, name: str, sources, key: str, verbose: bool, **flags) -> None:
    """cpp_extension.load of `sources` (files of csrc_dir, compiled from its staged copy, which is
    on the include path) into its own build_dir."""
    from torch.utils import cpp_extension

    # The shared libstdc++ torch uses, named first: a g++ that links libstdc++ statically (some
    # CUDA images' /opt/gcc wrapper) gives our library a private copy whose ostream segfaults
    # formatting a failed TORCH_CHECK's message.
    flags["extra_ldflags"] = ["-l:libstdc++.so.6", *flags.get("extra_ldflags", [])]
    out = build_dir(csrc_dir, key)
    out.mkdir(parents=True, exist_ok=True)
    staged = _staged(csrc_dir, out)
    logger.info("chunkattn: JIT-building %s (%s) in %s", name, key, out)
    cpp_extension.load(name=name, sources=[str(staged / Path(s).relative_to(csrc_dir))
                                           for s in sources],
                       extra_include_paths=[str(staged)], build_directory=str(out),
                       is_python_module=False, verbose=verbose, **flags)


def load_simt_emulation(csrc_dir, verbose: bool = False) -> None:
    """Builds (or reuses) and loads csrc/cuda_emu: torch.ops.chunkattn_simt.tpp_decode runs the
    CUDA kernel's own source (csrc/cuda/tpp_kernels.cuh) on CPU tensors through a SIMT emulation,
    and .ptx_probe the warp-instruction probe (csrc/ptx_probe).
    For tests on machines without a GPU; needs a C++ compiler only (no nvcc, no CUDA torch)."""
    csrc_dir = Path(csrc_dir)
    _load(csrc_dir, "vllm_chunkattn_simt",
          [csrc_dir / "cuda_emu" / f
           for f in ("simt_emu.cpp", "tpp_decode_emulated.cpp", "ptx_probe_emulated.cpp")],
          "simt-emulation", verbose, extra_cflags=["-O2", "-Wno-unknown-pragmas"])


def load_ptx_probe(csrc_dir, verbose: bool = False) -> None:
    """Builds (or reuses) and loads csrc/ptx_probe for the local GPU: torch.ops.chunkattn_probe.
    ptx_probe runs ldmatrix / mma.sync once on known operands (tests/kernels/test_ptx_probe.py compares it
    with the SIMT emulation). Test-only; needs nvcc and a CUDA torch."""
    from torch.utils import cpp_extension

    fix_cuda_home(cpp_extension)
    csrc_dir = Path(csrc_dir)
    archs = arch_list()
    _load(csrc_dir, "vllm_chunkattn_ptx_probe", [csrc_dir / "ptx_probe" / "ptx_probe_cuda.cu"],
          "ptx-probe " + ";".join(archs), verbose,
          extra_cuda_cflags=["-O3", *gencode_flags(archs)])
