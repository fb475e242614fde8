"""What the GPU host's image holds and what the serve path needs beside it: the facts bundle.py
plans the vLLM bundle from (the image's packages and versions, the optional imports, the groups
copied only when the host's install asks). Read off the image's package list and the wheels.
"""
from __future__ import annotations

from packaging.markers import default_environment

PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
DEVICE_ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
              "platform_machine": "x86_64", "sys_platform": "linux", "platform_system": "Linux",
              "implementation_name": "cpython", "platform_python_implementation": "CPython"}

# The GPU host's image (its package list read 2026-11-17; Python 3.12.3).
IMAGE_PACKAGES = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc
anyio attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama
contourpy coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist
fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp""".split()
# Versions read there (the image's pip list); the nvidia-* ones are torch 2.11.0's cu130 pins
# (its Requires-Dist, cuda-toolkit 13.0.2's extras), not readings: install_bundle.sh prints them.
IMAGE_VERSIONS = {
    "torch": "2.11.0", "triton": "3.6.0", "torchvision": "0.26.0", "torchaudio": "2.11.0",
    "transformers": "5.17.0", "huggingface-hub": "1.33.0", "tokenizers": "0.23.2",
    "safetensors": "0.8.0", "numpy": "2.5.2", "sentencepiece": "0.2.2", "tiktoken": "0.14.0",
    "accelerate": "1.15.0", "cupy-cuda13x": "14.2.0", "jax": "0.11.2", "onnx": "1.23.1",
    "nvidia-nccl-cu13": "2.28.9", "nvidia-cudnn-cu13": "9.19.0.56", "nvidia-cublas": "13.1.0.3",
    "nvidia-cusparselt-cu13": "0.8.0", "nvidia-nvshmem-cu13": "3.4.5",
    "nvidia-cuda-runtime": "13.0.96", "nvidia-cuda-nvrtc": "13.0.88",
    "nvidia-cuda-cupti": "13.0.85", "nvidia-cufft": "12.0.0.61", "nvidia-curand": "10.4.0.35",
    "nvidia-cusolver": "12.0.4.66", "nvidia-cusparse": "12.6.3.3", "nvidia-cufile": "1.15.1.6",
    "nvidia-nvtx": "13.0.85",
}
# Imported by the serve path only when installed; vLLM and torch fall back without them (closure
# re-checks: a name whose absence breaks an import is dropped from this list).
OPTIONAL_MODULES = ["flashinfer", "cutlass", "cudnn", "humming", "cuda.tile", "cutile_cache",
                    "fastsafetensors", "torchcodec", "tilelang"]
# vLLM 0.32.0 pins torch 2.13.0, but its CUDA extensions use torch's stable C ABI alone: the 91
# aoti_torch_* / torch_* symbols that _C_stable_libtorch, _moe_C_stable_libtorch and
# vllm_flash_attn's _vllm_fa2_C / _vllm_fa3_C import (no C++ libtorch symbol) are all exported by
# torch 2.11.0+cu130, the image's (nm -D on both wheels), and in a Python 3.12 venv
# with torch 2.11.0+cu130 and triton 3.6.0 (a stand-in libcuda.so.1, no GPU) they load and
# register their ops, and import_probe.py imports the whole serve path; vLLM's compile path keeps
# branches for torch 2.10 / 2.11 (env_override.py, config/compilation.py). So these travel as a
# group of their own after core, collected only if install's check on the image's torch fails
# (vLLM's ops and FlashAttention against references on the GPU): 9 of the 13 core parts.
TORCH_STACK = {"torch", "triton", "torchvision"}
# Not imported but dlopen'ed: torch 2.13's libtorch_cuda.so needs 8 symbols that NCCL 2.28.9 (the
# image's, by torch 2.11's pin) lacks: ncclCommSuspend/Resume/MemStats, ncclSignal/WaitSignal/
# PutSignal, ncclGet{Peer,LsaMultimem}DevicePointer (checked with nm -D against both wheels).
# nccl_compat.c defines them (single-GPU serving calls none), so this group, sent last, travels
# only if torch 2.13 did and the host's NCCL check fails with that shim (install_bundle.sh).
SHARED_LIBS = {"nvidia-nccl-cu13": "2.29.7"}
