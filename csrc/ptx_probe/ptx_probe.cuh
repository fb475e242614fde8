// The warp instructions the TPP kernels rest on (ldmatrix .x4 and .x4.trans, mma.sync m16n8k16),
// run once on known operands. Built by nvcc for a GPU (ptx_probe_cuda.cu) and for the SIMT
// emulation (csrc/cuda_emu/ptx_probe_emulated.cpp): tests/kernels/test_ptx_probe.py compares the two bit
// for bit on a GPU, which checks on the hardware the fragment layouts that the emulation, and so
// every emulated kernel test, assumes (they are read from the PTX ISA, not measured). If the GPU
// tests of the kernel fail, this says whether an instruction's layout is the cause.
// Test-only: jit_build.load_ptx_probe / load_simt_emulation build it, never setup.py.
#pragma once

#ifdef CHUNKATTN_SIMT_EMULATION
#include "../cuda_emu/simt_emu.h"
#else
#include <cuda_runtime.h>

#include "../cuda/tpp_ptx.cuh"
#endif
#include <ATen/ATen.h>
#include <stdint.h>

#include <tuple>

namespace chunkattn {

constexpr int kProbeSmemBytes = (16 * 16 + 8 * 16) * 2;

struct PtxProbeArgs {
  const uint16_t* a;   // the 16 x 16 mma A operand, row-major 16-bit patterns
  const uint16_t* bt;  // B transposed (n 8 x k 16), row-major
  uint32_t* ld;        // [32 lanes, 4] outputs, below
  uint32_t* ldt;
  float* mma;
};

// One warp. Outputs per lane: ld, the registers ldmatrix.x4 gives when lanes 8j..8j+7 address
// the rows of A's 8 x 8 block j (rows 8(j%2).., columns 8(j/2)..: the A fragment order); ldt, the
// same with .trans; mma, C + A B with A from ld, B from ldmatrix.x4 of bt (blocks: columns 0-7,
// 8-15, twice) and C = 4 lane + register.
template <typename T>
__global__ void ptx_probe_kernel(PtxProbeArgs p) {
  extern __shared__ __align__(16) char smem_raw[];
  uint16_t* sa = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* sb = sa + 16 * 16;
  const int lane = threadIdx.x;
  for (int i = lane; i < 16 * 16; i += 32) sa[i] = p.a[i];
  for (int i = lane; i < 8 * 16; i += 32) sb[i] = p.bt[i];
  __syncthreads();
  const int j = lane / 8, r = lane % 8;
  const uint16_t* a_row = sa + (8 * (j % 2) + r) * 16 + 8 * (j / 2);
  uint32_t fa[4], ft[4], fb[4];
  ldmatrix_x4(fa, a_row);
  ldmatrix_x4_trans(ft, a_row);
  ldmatrix_x4(fb, sb + r * 16 + 8 * (j % 2));
  float c[4];
  for (int i = 0; i < 4; ++i) c[i] = float(4 * lane + i);
  mma_16816<T>(c, fa, fb[0], fb[1]);
  for (int i = 0; i < 4; ++i) {
    p.ld[4 * lane + i] = fa[i];
    p.ldt[4 * lane + i] = ft[i];
    p.mma[4 * lane + i] = c[i];
  }
}

// A call of the probe, for both ops: the operands checked, the outputs (ld, ldt: int32 bit
// patterns; mma: fp32) made on a's device, and the kernel's pointers to them all.
struct PtxProbeCall {
  at::Tensor ld, ldt, mma;
  PtxProbeArgs args;
  bool half;
  std::tuple<at::Tensor, at::Tensor, at::Tensor> outputs() const { return {ld, ldt, mma}; }
};

inline PtxProbeCall ptx_probe_call(const at::Tensor& a, const at::Tensor& bt) {
  TORCH_CHECK(a.dim() == 2 && a.size(0) == 16 && a.size(1) == 16 && bt.dim() == 2 && bt.size(0) == 8 &&
                  bt.size(1) == 16,
              "ptx_probe: a must be 16 x 16 and bt 8 x 16");
  TORCH_CHECK(a.scalar_type() == bt.scalar_type() &&
                  (a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16),
              "ptx_probe: a and bt must both be float16 or both bfloat16");
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous() && a.device() == bt.device(),
              "ptx_probe: a and bt must be contiguous, on one device");
  const auto i32 = a.options().dtype(at::kInt);
  PtxProbeCall c{at::empty({32, 4}, i32), at::empty({32, 4}, i32),
                 at::empty({32, 4}, a.options().dtype(at::kFloat)), {}, a.scalar_type() == at::kHalf};
  c.args = {static_cast<const uint16_t*>(a.data_ptr()), static_cast<const uint16_t*>(bt.data_ptr()),
            static_cast<uint32_t*>(c.ld.data_ptr()), static_cast<uint32_t*>(c.ldt.data_ptr()),
            c.mma.data_ptr<float>()};
  return c;
}

}  // namespace chunkattn
