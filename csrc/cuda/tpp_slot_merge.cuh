// How a final CTA merges into its rows the partial states that the partial launch wrote to the
// workspace's slots (tpp_kernels.cuh says which slots a row has): the list of a row's slots,
// made from the plan alone, then the listed slots merged into the registers of each row's
// state. attend_tile (tpp_attend_tile.cuh) runs both when FINAL.
#pragma once

#include "tpp_params.cuh"

namespace chunkattn {

// exp2 offset for a running max: an empty state (m = -inf) uses 0 so -inf - (-inf) never occurs.
__device__ __forceinline__ float safe_max(float m) { return m == -INFINITY ? 0.f : m; }

// Merges slot `idx` (natural-log m) into a thread's share of one row's state (log2-domain m).
template <int D>
__device__ __forceinline__ void merge_slot(const TppParams& p, int64_t idx, int lane, float o[][4],
                                           int r, float& m2, float& l) {
  const float pm2 = p.partial_m[idx] * kLog2e;  // -inf stays -inf
  const float pl = p.partial_l[idx];
  const float mn = fmaxf(m2, pm2), ms = safe_max(mn);
  const float a = fast_exp2(m2 - ms), b = fast_exp2(pm2 - ms);
  const float* po = p.partial_o + idx * D + 2 * (lane % 4);
#pragma unroll
  for (int nb = 0; nb < D / 8; ++nb) {
    const float2 v = *reinterpret_cast<const float2*>(po + nb * 8);
    o[nb][2 * r] = o[nb][2 * r] * a + v.x * b;
    o[nb][2 * r + 1] = o[nb][2 * r + 1] * a + v.y * b;
  }
  l = l * a + pl * b;
  m2 = mn;
}

// A final CTA lists the slots the partial launch wrote for its sequence in smem (after the KV
// parts' merge buffer, in the KV stages, idle by then): the row's chunk partials over their KV
// splits, then its tail splits 1.. (split 0 is the CTA's own state). The list comes from the plan
// alone, so it is made before the wait for the partial grid, all threads loading at once; after
// the wait a slot costs one load of its state instead of the chain seq_partial_indptr ->
// seq_partial_ids -> state. Slots [base, base + n) of the row's order go to list[0, n).
__device__ __forceinline__ void list_row_slots(const TppParams& p, const ChunkSplits& cs, int seq,
                                               int k0, int chunk_slots, int base, int n, int* list) {
  for (int j = threadIdx.x; j < n; j += kThreads) {
    const int i = base + j;
    list[j] = int(i < chunk_slots ? cs.chunk_slot(i % cs.splits, p.seq_partial_ids[k0 + i / cs.splits])
                                  : cs.tail_slot(seq, 1 + i - chunk_slots, p.seq_splits));
  }
}

// The listed slots merged into this warp's row block (rb): the KV parts' warps share them, slot j
// going to part j % num_parts, so a row's dozen or so slots cost a few loads in parallel, not one
// chain; the parts' states are merged after.
template <int D, typename Sm>
__device__ __forceinline__ void merge_listed_slots(const TppParams& p, const Sm& sm, const int* list, int n,
                                                   int rb, int part, int num_parts, int lane, float o[][4],
                                                   float m2[2], float l[2]) {
  for (int j = part; j < n; j += num_parts) {
    const int64_t slot = list[j];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int h = sm.row_out[rb * 16 + lane / 4 + 8 * r];
      if (h >= 0) merge_slot<D>(p, slot * p.num_heads + h, lane, o, r, m2[r], l[r]);
    }
  }
}

}  // namespace chunkattn
