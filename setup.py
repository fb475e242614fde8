"""Builds vllm_chunkattn._C against the installed torch: the CPU kernel always, the CUDA kernel
when nvcc and a CUDA torch are present (or CHUNKATTN_BUILD_CUDA=1). Install with
`pip install --no-build-isolation -e .` so the build uses the torch already installed."""
import glob
import os

from setuptools import setup
from torch.utils import cpp_extension


def extension():
    sources = ["csrc/torch_bindings.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    cxx = ["-O3", "-std=c++17", "-fopenmp"]
    want_cuda = os.environ.get("CHUNKATTN_BUILD_CUDA",
                               "1" if cpp_extension.CUDA_HOME and _torch_has_cuda() else "0")
    if want_cuda == "1":
        return cpp_extension.CUDAExtension(
            "vllm_chunkattn._C", sources + sorted(glob.glob("csrc/cuda/*.cu")),
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++17"]},
            extra_link_args=["-fopenmp"])
    return cpp_extension.CppExtension("vllm_chunkattn._C", sources,
                                      extra_compile_args=cxx, extra_link_args=["-fopenmp"])


def _torch_has_cuda():
    import torch
    return torch.version.cuda is not None


setup(ext_modules=[extension()], cmdclass={"build_ext": cpp_extension.BuildExtension})
