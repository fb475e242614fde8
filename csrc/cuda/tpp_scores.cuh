// A stage's scores in a warp's registers (mma C fragments: s[nb][e], rows lane/4 and lane/4 + 8,
// tokens 2 * (lane % 4) + nb * 8 + e % 2 of the warp's part): the layer's soft cap and sliding
// window masks, the t_end mask and each row's max, before attend_tile's online softmax
// (tpp_attend_tile.cuh).
#pragma once

#include "tpp_params.cuh"

namespace chunkattn {

// Pairwise reduction of a thread's N values (N a power of two): log2(N) dependent steps where a
// running fold takes N - 1. The stage loop's row max and row sum fold 16 values a row at head
// 128: as running folds, chains of fixed-latency FMNMX / FADD, the warp stall Nsight Compute puts
// first at the served shape's chunk-first launch on an H200 ("wait", 1.10 warps an issue).
template <int N, typename Op>
__device__ __forceinline__ float tree_reduce(float (&v)[N], Op op) {
  static_assert((N & (N - 1)) == 0, "a power of two");
#pragma unroll
  for (int w = 1; w < N; w *= 2)
#pragma unroll
    for (int i = 0; i + w < N; i += 2 * w) v[i] = op(v[i], v[i + w]);
  return v[0];
}

// A row's values among a thread's scores s[nb][e]: row r of the thread's two is e = 2r, 2r + 1.
template <int NB>
__device__ __forceinline__ void row_values(const float s[][4], int r, float (&v)[2 * NB]) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    v[2 * nb] = s[nb][2 * r];
    v[2 * nb + 1] = s[nb][2 * r + 1];
  }
}

// A stage's raw scores (q.k, unscaled): MASK sets tokens at or past t_end to -inf (the zero-filled
// K rows); mx[r] = the max of the thread's share of row r. The scale is applied to the max alone
// and folded into the exponent's FFMA (scores * scale_log2 - max): the scale is positive
// (check_tpp_args), and rounding is monotonic, so max(s) * scale_log2 is exactly max(s *
// scale_log2) and the running max is the same as when each score was scaled first.
template <bool MASK, int NB>
__device__ __forceinline__ void mask_and_max(float s[][4], int tok0, int t_end, float mx[2]) {
  if constexpr (MASK) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (tok0 + nb * 8 + (e & 1) >= t_end) s[nb][e] = -INFINITY;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float v[2 * NB];
    row_values<NB>(s, r, v);
    mx[r] = tree_reduce(v, [](float a, float b) { return fmaxf(a, b); });
  }
}

// A soft cap: raw scores become log2-domain logits soft_cap_log2 * tanh(s * soft_cap_in),
// before any mask (a masked score stays -inf) and before the max (tanh is monotonic, and the
// kernel's scale_log2 is then 1).
template <int NB>
__device__ __forceinline__ void soft_cap_scores(float s[][4], float cap_log2, float cap_in) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nb][e] = cap_log2 * tanhf(s[nb][e] * cap_in);
}

// Tokens before each of the thread's two rows' window edges (lo[r], run coordinates) to -inf.
template <int NB>
__device__ __forceinline__ void mask_window(float s[][4], int tok0, const int lo[2]) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (tok0 + nb * 8 + (e & 1) < lo[e / 2]) s[nb][e] = -INFINITY;
}

}  // namespace chunkattn
