"""Whether the CUDA TPP kernel can run on a GPU, answered before anything is built or launched:
the backend asks at vLLM's backend selection, so `--attention-backend CUSTOM` on a GPU the kernel
cannot serve stops at start-up with the reason, not at the first decode (or its graph capture).
Imports no vLLM and touches no GPU."""
from __future__ import annotations

# Block sizes the CUDA kernel takes: powers of two (it finds a token's block by shift and mask,
# csrc/cuda/tpp_kernels.cuh), from 16 up, which FLASH_ATTN (it writes the KV cache and runs
# prefill under CUSTOM) also takes.
CUDA_BLOCK_SIZES = (16, 32, 64, 128, 256)
MIN_CAPABILITY = (8, 0)
NEEDS_CAPABILITY = (f"compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (cp.async, "
                    f"ldmatrix, bf16 mma)")

# Dynamic shared memory per block of the partial (chunk-first) kernel, the larger launch, by head
# size: csrc/cuda/tpp_params.cuh's tpp_partial_smem_bytes, which is not built before selection;
# tests/kernels/test_cuda_simt_emulation.py checks these against it.
PARTIAL_SMEM_BYTES = {64: 47104, 96: 67584, 128: 88064, 256: 102400}

# fp8 KV caches the kernel reads in place (vLLM's --kv-cache-dtype; "fp8" is e4m3 on CUDA), with
# per-tensor k/v scales, under fp16 or bf16 models: each stage is converted to the model's dtype
# in the shared memory a 16-bit cache's stages take, so the table above holds for them too.
CUDA_FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


def refusal(capability: tuple[int, int], head_size: int, smem_per_block_optin: int) -> str | None:
    """Why the kernel cannot serve this head size on a GPU of this compute capability and
    opt-in shared memory per block (0: unknown, not checked), or None when it can. Head sizes
    the kernel lacks are the backend's get_supported_head_sizes' to refuse."""
    if tuple(capability) < MIN_CAPABILITY:
        return (f"the CUDA TPP kernel needs {NEEDS_CAPABILITY}, this GPU is "
                f"{capability[0]}.{capability[1]}")
    need = PARTIAL_SMEM_BYTES.get(head_size, 0)
    if 0 < smem_per_block_optin < need:
        return (f"head_size {head_size} needs {need} bytes of shared memory per block in the CUDA "
                f"TPP kernel, this GPU ({capability[0]}.{capability[1]}) allows "
                f"{smem_per_block_optin}")
    return None


def fp8_refusal(kv_cache_dtype: str, model_dtype, per_head_quant_scales: bool = False
                ) -> str | None:
    """Why the kernel cannot read a KV cache of this fp8 kind for a model of this dtype
    (torch.dtype or its name), or None when it can (and for caches that are not fp8)."""
    if not kv_cache_dtype.startswith("fp8"):
        return None
    model = str(model_dtype).removeprefix("torch.")
    if kv_cache_dtype not in CUDA_FP8_KV_CACHE_DTYPES:
        return (f"an {kv_cache_dtype} KV cache in the CUDA TPP kernel (it reads "
                f"{', '.join(CUDA_FP8_KV_CACHE_DTYPES)})")
    if model not in ("float16", "bfloat16"):
        return (f"an {kv_cache_dtype} KV cache under a {model} model in the CUDA TPP kernel "
                "(fp16 / bf16 models only)")
    if per_head_quant_scales:
        return (f"per-head scales of an {kv_cache_dtype} KV cache in the CUDA TPP kernel "
                "(per-tensor only)")
    return None
