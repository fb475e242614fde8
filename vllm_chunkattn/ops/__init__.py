"""The TPP decode kernels: the native op of each device (csrc/cpu, csrc/cuda; native.py loads
it) and the PyTorch reference that specifies it (reference.py). Imports no vLLM; the plan/run API
over them is vllm_chunkattn.decode.
"""
from __future__ import annotations

from .cuda_fit import CUDA_BLOCK_SIZES
from .native import check_plan, kernel_name, native_ops, cpu_kv_layout, reads_cpu_attn_amx_layout
from .reference import dense_decode_oracle, tpp_decode_reference

__all__ = ["tpp_decode_reference", "dense_decode_oracle", "kernel_name", "native_ops",
           "check_plan", "cpu_kv_layout", "reads_cpu_attn_amx_layout", "CUDA_BLOCK_SIZES"]
