"""Builds vllm_chunkattn._C against the installed torch: the CPU kernel always, the CUDA kernel
when nvcc and a CUDA torch are present (or CHUNKATTN_BUILD_CUDA=1). Install with
`pip install --no-build-isolation -e .` so the build uses the torch already installed."""
import glob
import os

from setuptools import setup
from torch.utils import cpp_extension

# The CUDA kernel needs cp.async, ldmatrix and bf16 mma.sync: sm_80 and up. Explicit -gencode
# flags replace torch's TORCH_CUDA_ARCH_LIST default (which may name older GPUs and fail):
# sm_80 and sm_90a machine code, plus compute_80 PTX that newer GPUs compile at load time.
# (The JIT build, vllm_chunkattn/ops/jit_build.py, targets the local GPU instead.)
CUDA_GENCODE = ["-gencode", "arch=compute_80,code=sm_80",
                "-gencode", "arch=compute_90a,code=sm_90a",
                "-gencode", "arch=compute_80,code=compute_80"]


# The shared libstdc++ first: some g++ wrappers (the GPU image's /opt/gcc) link it statically,
# and a private copy segfaults formatting TORCH_CHECK messages (vllm_chunkattn/ops/jit_build.py).
LINK = ["-fopenmp", "-l:libstdc++.so.6"]


def extension():
    # csrc/*.cpp: the schemas and the host plan check; csrc/cpu: the CPU kernel.
    sources = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    # No -std flag: torch's BuildExtension adds the C++ standard its headers need (C++20 since
    # 2.13; torch 2.14's, which vLLM 0.33 pins, do not compile as C++17: std::strong_ordering).
    cxx = ["-O3", "-fopenmp"]
    want_cuda = os.environ.get("CHUNKATTN_BUILD_CUDA",
                               "1" if cpp_extension.CUDA_HOME and _torch_has_cuda() else "0")
    if want_cuda == "1":
        return cpp_extension.CUDAExtension(
            "vllm_chunkattn._C", sources + sorted(glob.glob("csrc/cuda/*.cu")),
            extra_compile_args={"cxx": cxx,
                                "nvcc": ["-O3", "--expt-relaxed-constexpr",
                                         *CUDA_GENCODE]},
            extra_link_args=LINK)
    return cpp_extension.CppExtension("vllm_chunkattn._C", sources,
                                      extra_compile_args=cxx, extra_link_args=LINK)


def _torch_has_cuda():
    import torch
    return torch.version.cuda is not None


if __name__ == "__main__":     # setuptools runs this file as __main__; tests import extension()
    setup(ext_modules=[extension()], cmdclass={"build_ext": cpp_extension.BuildExtension})
