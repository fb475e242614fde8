// TPP decode kernels on tensor cores (mma.sync m16n8k16, fp32 accumulation), framework-free.
//
// Work decomposition (sizes and KV splits chosen on the host: tpp_host.h, make_tpp_work):
//   launch 1, tpp_partial_kernel, grid (chunk CTAs + seq-split CTAs, num_kv_heads); S_c and the
//     slot layout come from chunk_splits_of (tpp_params.cuh: the host's for exact plans, the
//     CTAs' own for plans padded to a CUDA graph's capacities):
//     chunk item = (KV split s, window, head tile): the rows of one shared node that fall in one
//                  window of `chunk_seqs` partial positions (windows are aligned in partial space,
//                  so window w of node n is item w + n, found by a binary search over
//                  node_seq_indptr), times up to `chunk_heads` q heads of the kv group; it reads
//                  the node's tokens of split s once for all its rows and writes slot s*P + j.
//                  An exact plan's chunk CTA runs one item; a padded plan's grid holds a CTA
//                  per item its capacities allow or, for large capacities, one wave of CTAs,
//                  each looping over the real items (TppParams::chunk_ctas).
//     seq CTA    = (row i, split s >= 1, head tile): split s of row i's private tail, written to
//                  slot S_c*P + i*(S_s-1) + s-1.
//   launch 2, tpp_final_kernel, grid (num_seqs * seq head tiles, num_kv_heads): split 0 of row
//     i's private tail, then merges the slots of the row's partials and tail splits in registers,
//     normalises and writes out (and lse). On sm_90+ launch 2 is a programmatic dependent of
//     launch 1 (launch_tpp_decode's overlap_final): its CTAs start on the SMs launch 1's last
//     wave leaves idle, attend their tails, and wait for launch 1's grid before the merge.
// Slots are rows of the fp32 workspace partial_o/m/l [slots, num_heads(, head_size)]: with one
// split each, chunk partial j sits at slot j, exactly the plan's partial index.
#pragma once

#include "tpp_attend_tile.cuh"

namespace chunkattn {

// Row seq's first visible token of a KV run that starts at block `first_block` of its table: a
// sliding window's edge (positions [seq_len - W, seq_len) are seen), 0 without one.
__device__ __forceinline__ int window_edge(const TppParams& p, int seq, int first_block) {
  if (p.sliding_window <= 0) return 0;
  const int64_t edge = int64_t(p.seq_lens[seq]) - p.sliding_window - (int64_t(first_block) << p.block_size_log2);
  return edge > 0 ? int(edge) : 0;
}

// The private tail of row i: block_table[i, first_private:], tokens [lo, L) where lo is the
// row's window edge (0 without a window); split s of n covers [lo + s*per, lo + (s+1)*per) with
// per rounded up to whole smem stages.
struct TailRange {
  const int* ids;
  int t_begin, t_end;
};
template <int D>
__device__ __forceinline__ TailRange tail_range(const TppParams& p, int seq, int split,
                                                int num_splits) {
  const int first = p.seq_num_shared_blocks[seq];
  const int len = p.seq_lens[seq] - (first << p.block_size_log2);
  TailRange t{p.block_table + seq * p.bt_stride + first, 0, 0};
  const int lo = window_edge(p, seq, first);
  if (len <= lo) return t;
  constexpr int kT = TileShape<D>::kTokens;
  const int per = ((len - lo + num_splits - 1) / num_splits + kT - 1) / kT * kT;
  t.t_begin = min(len, lo + split * per);
  t.t_end = min(len, t.t_begin + per);
  return t;
}

// Row meta of a sequence-first CTA: the q heads [ht*seq_heads, +seq_heads) of the kv group.
__device__ __forceinline__ void seq_rows(const TppParams& p, int64_t* row_q, int* row_out,
                                         int seq, int kv_head, int ht, int64_t slot) {
  const int r = threadIdx.x;
  if (r < kMaxRows) {
    const int hh = ht * p.seq_heads + r;
    const bool valid = r < p.seq_heads && hh < p.group;
    const int h = kv_head * p.group + hh;
    row_q[r] = valid ? seq * p.q_stride_seq + h * p.q_stride_head : -1;
    row_out[r] = !valid ? -1 : slot < 0 ? h : int(slot * p.num_heads + h);
  }
}

// One chunk-first item of the partial launch: KV split `split`'s tokens of the node that holds
// window `win`, for the rows of that window (x = ((split * windows) + win) * head tiles + ht), in
// smem stages of TOKENS tokens.
template <typename T, int D, int TOKENS, bool FP8>
__device__ __forceinline__ void chunk_item(const TppParams& p, const Smem<T, D>& sm, const ChunkSplits& cs,
                                           int x, int kv_head) {
  const int ht = x % p.chunk_head_tiles;
  x /= p.chunk_head_tiles;
  const int win = x % cs.windows, split = x / cs.windows;
  // Node n's windows start at item floor(indptr[n] / chunk_seqs) + n: strictly increasing in n.
  const int* ind = p.node_seq_indptr;
  int lo = 0, hi = cs.nodes - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (ind[mid] / p.chunk_seqs + mid <= win) lo = mid; else hi = mid - 1;
  }
  const int n = lo, w = win - n;
  const int p_lo = max(ind[n], w * p.chunk_seqs);
  const int p_hi = min(ind[n + 1], (w + 1) * p.chunk_seqs);
  if (p_lo >= p_hi) return;  // a gap between nodes' windows
  const int num_rows = (p_hi - p_lo) * p.chunk_heads;
  const int r = threadIdx.x;
  if (r < kMaxRows) {
    const int j = r / p.chunk_heads, hh = ht * p.chunk_heads + r % p.chunk_heads;
    const bool valid = r < num_rows && hh < p.group;
    const int h = kv_head * p.group + hh;
    const int seq = valid ? p.node_seq_ids[p_lo + j] : 0;
    sm.row_q[r] = valid ? seq * p.q_stride_seq + h * p.q_stride_head : -1;
    sm.row_out[r] = valid ? int(cs.chunk_slot(split, p_lo + j) * p.num_heads + h) : -1;
    sm.row_lo[r] = valid ? window_edge(p, seq, p.node_first_block[n]) : 0;
  }
  __syncthreads();
  const int b0 = p.node_block_indptr[n];
  const int len = (p.node_block_indptr[n + 1] - b0) << p.block_size_log2;
  constexpr int kT = TileShape<D>::kTokens;
  const int per = ((len + cs.splits - 1) / cs.splits + kT - 1) / kT * kT;
  const int t_begin = min(len, split * per), t_end = min(len, t_begin + per);
  const int* ids = p.node_block_ids + b0;
  // Fewer rows -> more warps split the KV instead (an empty split still writes m = -inf).
  if (num_rows <= 16)
    attend_tile<T, D, 1, false, TOKENS, FP8>(p, sm, ids, t_begin, t_end, kv_head, -1);
  else if (num_rows <= 32)
    attend_tile<T, D, 2, false, TOKENS, FP8>(p, sm, ids, t_begin, t_end, kv_head, -1);
  else
    attend_tile<T, D, 4, false, TOKENS, FP8>(p, sm, ids, t_begin, t_end, kv_head, -1);
}

// TOKENS: the partial launch's smem stage (TppParams::partial_stage_tokens, with_partial_stage);
// FP8: an fp8 cache (with_tpp_types).
template <typename T, int D, int TOKENS, bool FP8>
__global__ void __launch_bounds__(kThreads, partial_min_ctas(D, TOKENS)) tpp_partial_kernel(const TppParams p) {
  extern __shared__ __align__(16) char smem_raw[];
  Smem<T, D> sm(smem_raw, kMaxRows);
  launch_dependents();  // the final launch may take the SMs this grid leaves idle from now on
  const int kv_head = blockIdx.y;
  const ChunkSplits cs = chunk_splits_of(p);
  if (int(blockIdx.x) < p.chunk_ctas) {
    // An exact plan's CTA runs its one item; a padded plan's CTAs run one item of the real tree
    // or none, or, for large capacities, loop over its items (make_tpp_work).
    const int items = cs.splits * cs.windows * p.chunk_head_tiles;
    for (int x = blockIdx.x; x < items; x += p.chunk_ctas) {
      if (x != int(blockIdx.x)) __syncthreads();  // the last item's smem is read to the end
      chunk_item<T, D, TOKENS, FP8>(p, sm, cs, x, kv_head);
    }
  } else {
    int x = blockIdx.x - p.chunk_ctas;
    const int ht = x % p.seq_head_tiles;
    x /= p.seq_head_tiles;
    const int split = 1 + x % (p.seq_splits - 1), seq = x / (p.seq_splits - 1);
    const int64_t slot = cs.tail_slot(seq, split, p.seq_splits);
    seq_rows(p, sm.row_q, sm.row_out, seq, kv_head, ht, slot);
    __syncthreads();
    const TailRange t = tail_range<D>(p, seq, split, p.seq_splits);
    attend_tile<T, D, 1, false, TOKENS, FP8>(p, sm, t.ids, t.t_begin, t.t_end, kv_head, seq);
  }
}

// TOKENS: the final launch's smem stage (TppParams::final_stage_tokens, with_final_stage).
template <typename T, int D, int TOKENS, bool FP8>
__global__ void __launch_bounds__(kThreads, final_min_ctas(D, TOKENS)) tpp_final_kernel(const TppParams p) {
  extern __shared__ __align__(16) char smem_raw[];
  Smem<T, D> sm(smem_raw, 16);
  const int kv_head = blockIdx.y;
  const int seq = blockIdx.x / p.seq_head_tiles, ht = blockIdx.x % p.seq_head_tiles;
  seq_rows(p, sm.row_q, sm.row_out, seq, kv_head, ht, -1);
  __syncthreads();
  const TailRange t = tail_range<D>(p, seq, 0, p.seq_splits);  // split bounds: the default stage
  attend_tile<T, D, 1, true, TOKENS, FP8>(p, sm, t.ids, t.t_begin, t.t_end, kv_head, seq);
}

// Calls f(std::integral_constant<int, TOKENS>{}) with a launch's stage size: the compact stage
// where `tokens` asks for it, else the head size's default. The one place a call's stage sizes
// pick kernel instantiations (the launches, their shapes and the CPU emulation go through the
// two below).
template <int D, typename F>
decltype(auto) with_stage(int tokens, F&& f) {
  constexpr int kDefault = default_stage_tokens(D);
  if constexpr (kDefault != kCompactStageTokens)
    if (tokens == kCompactStageTokens) return f(std::integral_constant<int, kCompactStageTokens>{});
  return f(std::integral_constant<int, kDefault>{});
}
template <int D, typename F>
decltype(auto) with_partial_stage(const TppParams& p, F&& f) {
  return with_stage<D>(p.partial_stage_tokens, f);
}
template <int D, typename F>
decltype(auto) with_final_stage(const TppParams& p, F&& f) {
  return with_stage<D>(p.final_stage_tokens, f);
}

// Grids (x; y is num_kv_heads) and dynamic smem of the two launches, all from host ints, so a
// captured graph replays them as is. The CPU emulation launches the same shapes.
struct TppLaunchShape {
  int partial_grid_x, final_grid_x, partial_smem, final_smem;
};
template <int D>
inline TppLaunchShape tpp_launch_shape(const TppParams& p) {
  const int partial_smem = with_partial_stage<D>(
      p, [](auto tokens) { return TileShape<D, decltype(tokens)::value>::smem_bytes(kMaxRows); });
  const int final_smem =
      with_final_stage<D>(p, [](auto tokens) { return TileShape<D, decltype(tokens)::value>::smem_bytes(16); });
  return {p.chunk_ctas + p.num_seqs * (p.seq_splits - 1) * p.seq_head_tiles,
          p.num_seqs * p.seq_head_tiles, partial_smem, final_smem};
}

#ifndef CHUNKATTN_SIMT_EMULATION
// overlap_final (sm_90+): the final launch is a programmatic dependent of the partial one, so
// its CTAs take the SMs the partial launch's last wave leaves idle and attend their private tails
// meanwhile; they wait for the partial grid before merging its slots (wait_for_primary_grid).
template <typename T, bool FP8, int D>
cudaError_t launch_tpp_decode(const TppParams& p, cudaStream_t stream, bool overlap_final) {
  const TppLaunchShape shape = tpp_launch_shape<D>(p);
  // Opting in to > 48 KB of dynamic smem is a host-side attribute of the current context, not a
  // stream op (allowed while a graph is captured): set on every launch, so a new context (after
  // a device reset) or another thread never launches without it.
  void (*partial_kernel)(TppParams) =
      with_partial_stage<D>(p, [](auto tokens) { return &tpp_partial_kernel<T, D, decltype(tokens)::value, FP8>; });
  cudaError_t attr = cudaFuncSetAttribute(partial_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          shape.partial_smem);
  if (attr != cudaSuccess) return attr;
  void (*final_kernel)(TppParams) =
      with_final_stage<D>(p, [](auto tokens) { return &tpp_final_kernel<T, D, decltype(tokens)::value, FP8>; });
  attr = cudaFuncSetAttribute(final_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shape.final_smem);
  if (attr != cudaSuccess) return attr;
  if (shape.partial_grid_x > 0) {
    partial_kernel<<<dim3(shape.partial_grid_x, p.num_kv_heads), kThreads, shape.partial_smem, stream>>>(p);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  if (shape.final_grid_x > 0) {
    cudaLaunchAttribute overlap[1] = {};
    overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(shape.final_grid_x, p.num_kv_heads);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = shape.final_smem;
    cfg.stream = stream;
    cfg.attrs = overlap;
    cfg.numAttrs = overlap_final && shape.partial_grid_x > 0 ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, final_kernel, p);
  }
  return cudaSuccess;
}

// Partial-kernel CTAs one SM runs at once in stages of `tokens` (partial_stage_tokens),
// registers and shared memory both counted (ptxas, sm_90a, head 128: 242 registers and 88,064
// bytes of smem allow 2 in the default stage, the compact stage's 168 and 54,016 allow 3), 0 if
// the runtime cannot tell. The split choice (tpp_host.h) sizes its waves by it.
template <typename T, bool FP8, int D>
int tpp_partial_ctas_per_sm(int tokens) {
  return with_stage<D>(tokens, [](auto t) {
    constexpr int kTokens = decltype(t)::value;
    void (*kernel)(TppParams) = &tpp_partial_kernel<T, D, kTokens, FP8>;
    const int smem = TileShape<D, kTokens>::smem_bytes(kMaxRows);
    int n = 0;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem) != cudaSuccess) {
      (void)cudaGetLastError();  // not the launch's error: the launch checks cudaGetLastError
      return 0;
    }
    return n;
  });
}

// One (query dtype, KV kind)'s instantiations: PREFIX empty in tpp_kernels_{fp16,bf16}{,_fp8kv}.cu
// (one file each so they compile in parallel), `extern` for every other includer; the signatures
// live here only.
#define CHUNKATTN_TPP_INSTANCES(PREFIX, T, FP8)                                                       \
  PREFIX template cudaError_t launch_tpp_decode<T, FP8, 64>(const TppParams&, cudaStream_t, bool);  \
  PREFIX template cudaError_t launch_tpp_decode<T, FP8, 96>(const TppParams&, cudaStream_t, bool);  \
  PREFIX template cudaError_t launch_tpp_decode<T, FP8, 128>(const TppParams&, cudaStream_t, bool); \
  PREFIX template cudaError_t launch_tpp_decode<T, FP8, 256>(const TppParams&, cudaStream_t, bool); \
  PREFIX template int tpp_partial_ctas_per_sm<T, FP8, 64>(int);                                      \
  PREFIX template int tpp_partial_ctas_per_sm<T, FP8, 96>(int);                                      \
  PREFIX template int tpp_partial_ctas_per_sm<T, FP8, 128>(int);                                     \
  PREFIX template int tpp_partial_ctas_per_sm<T, FP8, 256>(int);
#ifndef CHUNKATTN_INSTANTIATE
CHUNKATTN_TPP_INSTANCES(extern, __half, false)
CHUNKATTN_TPP_INSTANCES(extern, __nv_bfloat16, false)
CHUNKATTN_TPP_INSTANCES(extern, __half, true)
CHUNKATTN_TPP_INSTANCES(extern, __nv_bfloat16, true)
#endif
#endif  // CHUNKATTN_SIMT_EMULATION

}  // namespace chunkattn
