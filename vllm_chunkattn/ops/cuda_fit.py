"""Whether the CUDA TPP kernel can run on a GPU, answered before anything is built or launched:
the backend asks at vLLM's backend selection, so `--attention-backend CUSTOM` on a GPU the kernel
cannot serve stops at start-up with the reason, not at the first decode (or its graph capture).
Imports no vLLM and touches no GPU."""
from __future__ import annotations

MIN_CAPABILITY = (8, 0)   # cp.async, ldmatrix and bf16 mma.sync

# csrc/cuda/tpp_kernels.cuh's TileShape, for the partial (chunk-first) kernel, the larger launch:
# kWarps = 4 warps of 16 query rows; per stage kTokens K and V rows padded to head + 8 halves.
_KERNEL_ROWS = 64
_STAGES = 2


def partial_smem_bytes(head_size: int) -> int:
    """Dynamic shared memory per block the kernel asks for at this head size (bytes);
    tests/test_cuda_simt_emulation.py checks it against the C++ tpp_partial_smem_bytes."""
    tokens = 64 if head_size <= 128 else 32
    row = (head_size + 8) * 2
    meta = -(-_KERNEL_ROWS * 12 // 16) * 16
    return meta + _KERNEL_ROWS * row + _STAGES * 2 * tokens * row


def refusal(capability: tuple[int, int], head_size: int, smem_per_block_optin: int) -> str | None:
    """Why the kernel cannot serve this head size on a GPU of this compute capability and
    opt-in shared memory per block (0: unknown, not checked), or None when it can."""
    if tuple(capability) < MIN_CAPABILITY:
        return (f"the CUDA TPP kernel needs compute capability >= 8.0 (cp.async, ldmatrix, bf16 "
                f"mma), this GPU is {capability[0]}.{capability[1]}")
    need = partial_smem_bytes(head_size)
    if 0 < smem_per_block_optin < need:
        return (f"head_size {head_size} needs {need} bytes of shared memory per block in the CUDA "
                f"TPP kernel, this GPU ({capability[0]}.{capability[1]}) allows "
                f"{smem_per_block_optin}")
    return None
