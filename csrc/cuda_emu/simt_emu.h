// A CPU stand-in for the part of CUDA that csrc/cuda/tpp_kernels.cuh (and the headers it includes) uses, so that its kernels,
// unchanged, run in tests on a machine without a GPU (tests/kernels/test_cuda_simt_emulation.py).
//
// Each CUDA thread of a CTA is a fiber (simt_emu.cpp); CTAs run one after another. The warp
// instructions (ldmatrix, mma.sync m16n8k16, shfl) exchange every lane's operands and compute
// each lane's fragment from the PTX ISA's fragment layouts, written here independently of the
// kernel, so a wrong layout assumption in the kernel gives wrong numbers here. Stricter than a
// GPU where it is cheap to be: cp.async data lands only at the cp.async.wait_group that must
// cover it; shared memory starts as NaN bytes; every ldmatrix / cp.async address is checked
// against the launch's shared memory and the call's tensors; a warp instruction reached by only
// part of a warp, or __syncthreads after threads exited, is an error; a dependent launch's CTA
// (the op's final kernel, which may overlap the partial one on a GPU) finds the partial slots NaN
// until it waits for the primary grid (tpp_decode_emulated.cpp).
// Included by tpp_params.cuh in place of the CUDA headers when CHUNKATTN_SIMT_EMULATION is set.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <vector>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
#define threadIdx (::simt::thread_idx)
#define blockIdx (::simt::block_idx)

using __half = c10::Half;
using __nv_bfloat16 = c10::BFloat16;

struct alignas(8) float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

namespace simt {

struct Index3 {
  unsigned x, y, z;
};
extern Index3 thread_idx, block_idx;  // of the fiber running now

constexpr int kSharedCapacity = 232448;  // 227 KB: the most a block may opt in to (sm_90)
constexpr int kSharedGuard = 4096;

struct GlobalRange {  // the bytes of one tensor of the call
  const void* begin;
  int64_t bytes;
};
struct LaunchOptions {
  unsigned seed = 0;                     // of the random CTA order, thread order and warp drift
  bool cp_async_lands_at_issue = false;  // the other legal extreme: data in smem at once
  // A programmatic dependent launch (griddepcontrol): before_cta runs as each CTA starts, and
  // primary_grid_done the first time one of its threads waits for the primary grid.
  std::function<void()> before_cta, primary_grid_done;
};
void wait_for_primary_grid();  // griddepcontrol.wait of the thread running now
// Runs kernel() as grid_x x grid_y CTAs of `threads` threads with `smem_bytes` of dynamic shared
// memory; throws std::runtime_error naming the CTA and thread on the first error.
void launch(int grid_x, int grid_y, int threads, int smem_bytes, const std::function<void()>& kernel,
            const std::vector<GlobalRange>& globals, const LaunchOptions& options);

// One lane's operands of a warp instruction.
enum class WarpOp { kNone, kShfl, kLdmatrix, kLdmatrixTrans, kMma };
struct LaneOperands {
  WarpOp op = WarpOp::kNone;
  const void* ptr = nullptr;  // ldmatrix: this lane's row address
  uint32_t a[4] = {};         // mma A fragment
  uint32_t b[2] = {};         // mma B fragment
  double value = 0.0;         // shfl (float and double travel exactly as double)
  unsigned mask = 0;          // shfl member mask
};

// Posts this lane's operands and waits for the whole warp; returns the 32 lanes' operands
// (checked to be the same instruction). Call warp_done() once the lane has read what it needs.
const LaneOperands* warp_exchange(const LaneOperands& mine);
void warp_done();
void syncthreads();

// cp.async of `size` bytes (4, 8 or 16), the first src_bytes of them read, the rest zero.
void cp_async(void* dst, const void* src, int size, int src_bytes);
void cp_async_commit();
void cp_async_wait(int pending);

// Fails the launch unless [p, p + bytes) lies inside the launch's dynamic shared memory
// (check_shared) or inside one tensor of the call (check_global), aligned to `align`.
void check_shared(const void* p, int bytes, int align, const char* what);
void check_global(const void* p, int bytes, int align, const char* what);
[[noreturn]] void fail(const char* what);

}  // namespace simt

inline void __syncthreads() { simt::syncthreads(); }

template <typename V>  // float or double, as CUDA's overloads
inline V __shfl_xor_sync(unsigned mask, V v, int lane_mask) {
  static_assert(std::is_same_v<V, float> || std::is_same_v<V, double>, "float or double shuffles");
  simt::LaneOperands mine;
  mine.op = simt::WarpOp::kShfl;
  mine.value = v;
  mine.mask = mask;
  const simt::LaneOperands* all = simt::warp_exchange(mine);
  if (mask != 0xffffffffu) simt::fail("__shfl_xor_sync: only a full warp mask is emulated");
  const V r = V(all[(threadIdx.x % 32) ^ unsigned(lane_mask)].value);
  simt::warp_done();
  return r;
}

template <typename T>
inline T __ldg(const T* p) {
  simt::check_global(p, sizeof(T), alignof(T), "__ldg");
  return *p;
}

namespace chunkattn {

extern char smem_raw[];  // the dynamic shared memory of the CTA running now

// ---- the functions of csrc/cuda/tpp_ptx.cuh ----

inline void cp_async_16(void* dst, const void* src, int src_bytes) { simt::cp_async(dst, src, 16, src_bytes); }
inline void cp_async_8(void* dst, const void* src, int src_bytes) { simt::cp_async(dst, src, 8, src_bytes); }
inline void cp_async_commit() { simt::cp_async_commit(); }
// The emulation runs the final launch after the partial one has ended; what it checks is that a
// final CTA reads the partial slots only after it waited (LaunchOptions::primary_grid_done).
inline void launch_dependents() {}
inline void wait_for_primary_grid() { simt::wait_for_primary_grid(); }
template <int N>
inline void cp_async_wait() {
  simt::cp_async_wait(N);
}

template <typename T>
inline float bits_to_float(uint16_t bits) {
  return float(T(bits, T::from_bits()));
}

// ldmatrix .m8n8 .x4 .b16: lanes 8j..8j+7 give the row addresses of matrix j (8 rows of 8
// 16-bit elements); lane L receives in register j the elements (L/4, 2(L%4)) and (L/4, 2(L%4)+1)
// of matrix j, or with .trans those of its transpose: (2(L%4), L/4) and (2(L%4)+1, L/4).
inline void ldmatrix(uint32_t r[4], const void* p, bool trans) {
  simt::check_shared(p, 16, 16, "ldmatrix row address");
  simt::LaneOperands mine;
  mine.op = trans ? simt::WarpOp::kLdmatrixTrans : simt::WarpOp::kLdmatrix;
  mine.ptr = p;
  const simt::LaneOperands* all = simt::warp_exchange(mine);
  const int lane = threadIdx.x % 32;
  for (int j = 0; j < 4; ++j) {
    auto elem = [&](int row, int col) { return static_cast<const uint16_t*>(all[8 * j + row].ptr)[col]; };
    const int g = lane / 4, t = lane % 4;
    const uint16_t lo = trans ? elem(2 * t, g) : elem(g, 2 * t);
    const uint16_t hi = trans ? elem(2 * t + 1, g) : elem(g, 2 * t + 1);
    r[j] = uint32_t(lo) | uint32_t(hi) << 16;
  }
  simt::warp_done();
}
inline void ldmatrix_x4(uint32_t r[4], const void* p) { ldmatrix(r, p, false); }
inline void ldmatrix_x4_trans(uint32_t r[4], const void* p) { ldmatrix(r, p, true); }

// mma.sync .m16n8k16 .row.col, f32 accumulators. With g = lane/4, t = lane%4 (PTX ISA, "matrix
// fragments for mma.m16n8k16"): A register i holds row g + 8(i%2), columns 2t + 8(i/2) + {0,1};
// B register i holds rows (k) 2t + 8i + {0,1} of column (n) g; C/D element i is row g + 8(i/2),
// column 2t + i%2. Products of 16-bit inputs are exact in fp32; the sum runs in fp32 in k order.
template <typename T>
inline void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  simt::LaneOperands mine;
  mine.op = simt::WarpOp::kMma;
  for (int i = 0; i < 4; ++i) mine.a[i] = a[i];
  mine.b[0] = b0;
  mine.b[1] = b1;
  const simt::LaneOperands* all = simt::warp_exchange(mine);
  auto half_of = [](uint32_t reg, int k) { return uint16_t(k % 2 ? reg >> 16 : reg & 0xffff); };
  auto A = [&](int row, int k) {
    const uint32_t reg = all[4 * (row % 8) + (k % 8) / 2].a[row / 8 + 2 * (k / 8)];
    return bits_to_float<T>(half_of(reg, k));
  };
  auto B = [&](int k, int n) {
    const uint32_t reg = all[4 * n + (k % 8) / 2].b[k / 8];
    return bits_to_float<T>(half_of(reg, k));
  };
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float d[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    float acc = c[i];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    d[i] = acc;
  }
  simt::warp_done();
  for (int i = 0; i < 4; ++i) c[i] = d[i];
}

// ex2.approx.ftz.f32: 2^x, a denormal result flushed to 0 (the SFU's approximation differs
// from exp2f in the last bits; tests compare with tolerances).
inline float fast_exp2(float x) {
  const float y = std::exp2(x);
  return y < FLT_MIN ? 0.f : y;
}

template <typename T>
inline uint32_t pack2(float lo, float hi) {  // round to nearest even, lo in the low half
  return uint32_t(T(lo).x) | uint32_t(T(hi).x) << 16;
}

// Eight fp8 values of shared memory as eight T, through c10's fp8 types (every e4m3 / e5m2 value
// is exact in fp16 and bf16): an independent conversion, so a wrong one in the kernel's
// tpp_ptx.cuh is not copied here. Both addresses are checked.
template <typename T, bool E5M2>
inline void fp8x8_to_smem(T* dst, const uint8_t* src) {
  simt::check_shared(src, 8, 8, "fp8 stage read");
  simt::check_shared(dst, 16, 16, "fp8 stage write");
  for (int i = 0; i < 8; ++i) {
    const float v = E5M2 ? float(c10::Float8_e5m2(src[i], c10::Float8_e5m2::from_bits()))
                         : float(c10::Float8_e4m3fn(src[i], c10::Float8_e4m3fn::from_bits()));
    dst[i] = T(v);
  }
}

template <typename T>
inline void store2(T* dst, float a, float b) {
  simt::check_global(dst, 2 * sizeof(T), 2 * sizeof(T), "store2");
  dst[0] = T(a);
  dst[1] = T(b);
}

}  // namespace chunkattn
