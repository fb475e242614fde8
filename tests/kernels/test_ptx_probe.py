"""The warp instructions under the CUDA kernel (ldmatrix .x4 / .x4.trans, mma.sync m16n8k16), one
probe kernel (csrc/ptx_probe) run through the SIMT emulation here and on the GPU there.

Here: what holds whatever the fragment layout is. ldmatrix moves each of the 256 elements of the
16 x 16 operand to exactly one lane's register half, and mma.sync's 128 outputs minus their C
are exactly the 128 entries of A B (torch's matmul; small integers, so every sum is exact).
On a GPU: the hardware's registers equal the emulation's bit for bit, which checks the fragment
layouts the emulation reads from the PTX ISA, and so what every emulated kernel test assumes."""
from __future__ import annotations

import pytest
import torch
from conftest import SIMT_CSRC

DTYPES = [torch.float16, torch.bfloat16]


def operands(dtype):
    """A: -128..127, distinct and exact in fp16 and bf16 (8 significant bits); B^T: -8..8."""
    a = (torch.arange(256, dtype=torch.float32) - 128).reshape(16, 16).to(dtype)
    bt = (torch.arange(128) * 7 % 17 - 8).to(torch.float32).reshape(8, 16).to(dtype)
    return a, bt


def halves(regs: torch.Tensor) -> torch.Tensor:
    """[32, 4] int32 registers -> the 256 16-bit patterns they hold."""
    r = regs.to(torch.int64) & 0xFFFFFFFF
    return torch.cat([r & 0xFFFF, r >> 16]).flatten()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16).to(torch.int64).flatten() & 0xFFFF


C_INIT = torch.arange(128, dtype=torch.float32).reshape(32, 4)    # 4 lane + register


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_emulated_instructions_move_every_element_once_and_multiply_exactly(emu, dtype, seed):
    a, bt = operands(dtype)
    ld, ldt, mma = emu.ptx_probe(a, bt, seed)
    for regs in (ld, ldt):
        assert torch.equal(halves(regs).sort().values, bits(a).sort().values)
    assert not torch.equal(ld, ldt)                     # .trans hands out other elements
    product = a.float() @ bt.float().T                  # [16, 8]
    assert torch.equal((mma - C_INIT).flatten().sort().values, product.flatten().sort().values)


def test_probe_rejects_bad_operands(emu):
    a, bt = operands(torch.float16)
    with pytest.raises(RuntimeError, match="a must be 16 x 16"):
        emu.ptx_probe(a[:8], bt, 0)
    with pytest.raises(RuntimeError, match="float16 or both bfloat16"):
        emu.ptx_probe(a, bt.to(torch.bfloat16), 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_registers_equal_the_emulation(emu, dtype):
    from vllm_chunkattn.ops.jit_build import load_ptx_probe
    load_ptx_probe(SIMT_CSRC)
    a, bt = operands(dtype)
    got = [t.cpu() for t in torch.ops.chunkattn_probe.ptx_probe(a.cuda(), bt.cuda())]
    want = emu.ptx_probe(a, bt, 0)
    for name, g, w in zip(("ldmatrix.x4", "ldmatrix.x4.trans", "mma.sync m16n8k16"), got, want):
        lanes = (g != w).any(dim=1).nonzero().flatten().tolist()
        assert not lanes, (f"{name} ({dtype}): the GPU's registers differ from the emulation's "
                           f"in lanes {lanes}: GPU {g[lanes[:4]].tolist()} vs emulation "
                           f"{w[lanes[:4]].tolist()}; csrc/cuda_emu/simt_emu.h assumes a wrong "
                           f"fragment layout, and the kernel may too")
