// The PTX instructions the TPP kernels use (sm_80+): cp.async, ldmatrix, mma.sync m16n8k16,
// fp16/bf16 packing and fp8 (e4m3 / e5m2) conversion. csrc/cuda_emu/simt_emu.h defines the same
// functions for the CPU emulation that runs tpp_kernels.cuh in tests; keep the two in step.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

namespace chunkattn {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes == 0 zero-fills the destination (masked tokens, absent rows).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(src_bytes));
}
// 8-byte async copy (8 values of an fp8 KV cache), zero fill as cp_async_16. .ca: .cg takes only
// 16-byte copies.
__device__ __forceinline__ void cp_async_8(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Programmatic dependent launch (sm_90+; nothing below it, and nothing when the final kernel is
// launched without the attribute): the partial kernel lets the final launch start once every
// partial CTA runs; the final kernel waits for the whole partial grid, and its memory, before it
// reads the partial slots.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_primary_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

template <typename T>
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0,
                                          uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__half>(float c[4], const uint32_t a[4], uint32_t b0,
                                                  uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float c[4], const uint32_t a[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x on the SFU, denormal results flushed to 0. exp2f without --use_fast_math is the same
// ex2.approx plus a range fix for denormal results (FSETP, FMUL before, FMUL after: 4
// instructions, not 1; SASS of sm_90a, nvcc 13.0). An online-softmax weight under 2^-126 of
// its row's max adds nothing an fp32 sum keeps; -inf (a masked score) gives 0 either way.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <typename T>
__device__ __forceinline__ void store2(T* dst, float a, float b);
template <>
__device__ __forceinline__ void store2<__half>(__half* dst, float a, float b) {
  *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(a, b);
}
template <>
__device__ __forceinline__ void store2<__nv_bfloat16>(__nv_bfloat16* dst, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
}

// Two fp8 values (the low two bytes of x, the first in the low byte) as an fp16 pair, exactly:
// every e4m3 and e5m2 value is an fp16 (NaN stays NaN).
template <bool E5M2>
__device__ __forceinline__ uint32_t fp8x2_to_half2(uint32_t x) {
  if constexpr (E5M2) {
    return ((x & 0xffu) << 8) | ((x & 0xff00u) << 16);  // e5m2 is an fp16's top byte
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint32_t h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"(uint16_t(x)));
    return h;
#else
    // No fp8 cvt below sm_89. e4m3's exponent and mantissa (bias 7) in fp16's fields (bias 15)
    // read as the value times 2^-8, subnormals included, so times 2^8 (exact) is the value.
    // e4m3 has no infinities; 0x7f and 0xff are its NaNs.
    const uint32_t bits = ((x & 0x7fu) << 7) | ((x & 0x80u) << 8) | ((x & 0x7f00u) << 15) | ((x & 0x8000u) << 16);
    const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&bits), __float2half2_rn(256.f));
    uint32_t h = *reinterpret_cast<const uint32_t*>(&v);
    if ((x & 0x7fu) == 0x7fu) h |= 0x7fffu;
    if ((x & 0x7f00u) == 0x7f00u) h |= 0x7fff0000u;
    return h;
#endif
  }
}

// Two fp8 values as a packed pair of T (fp16 -> fp32 -> bf16 is exact for them too).
template <typename T, bool E5M2>
__device__ __forceinline__ uint32_t fp8x2_to(uint32_t x) {
  const uint32_t h = fp8x2_to_half2<E5M2>(x);
  if constexpr (std::is_same_v<T, __half>) {
    return h;
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
    return *reinterpret_cast<const uint32_t*>(&b);
  }
}

// Eight fp8 values in shared memory (src, 8-byte aligned) as eight T (dst, 16-byte aligned).
template <typename T, bool E5M2>
__device__ __forceinline__ void fp8x8_to_smem(T* dst, const uint8_t* src) {
  const uint2 raw = *reinterpret_cast<const uint2*>(src);
  uint4 v;
  v.x = fp8x2_to<T, E5M2>(raw.x);
  v.y = fp8x2_to<T, E5M2>(raw.x >> 16);
  v.z = fp8x2_to<T, E5M2>(raw.y);
  v.w = fp8x2_to<T, E5M2>(raw.y >> 16);
  *reinterpret_cast<uint4*>(dst) = v;
}

}  // namespace chunkattn
