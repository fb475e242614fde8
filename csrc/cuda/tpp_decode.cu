// Torch glue of the CUDA TPP decode: argument checks, the split-KV choice, dtype / head-size
// dispatch, and the CUDA kernel of chunkattn::tpp_decode (schema: csrc/torch_bindings.cpp).
//
// CUDA graphs. The op never synchronises with the host and allocates nothing: every grid size
// comes from host ints (tensor shapes, the SM count, env overrides). Two modes, same code:
//   exact:    plan tensors sized by the plan (num_nodes, num_partials from their shapes);
//   capacity: plan tensors padded to fixed capacities for a captured batch size: extra nodes
//             are empty (node_*_indptr repeat their last value), extra rows have seq_len 0 and
//             an empty seq_partial range. Grids are sized by the capacities and the CTAs of empty
//             nodes / rows exit or write empty states (m = -inf), so one capture replays any plan
//             that fits. Padded rows come out as 0 with lse = -inf. Every per-row tensor has the
//             padded row count (the shared contract); the index checks ran before padding.
// Split-KV scratch. partial_o/m/l rows past num_partials are spare slots: with S_c KV splits per
// chunk partial and S_s per private tail the op needs S_c*P + num_seqs*(S_s - 1) rows, and lowers
// S_s, then S_c, to what the workspace holds; a workspace of exactly num_partials rows means no
// split at all (still correct). The schema stays as it is.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <utility>

#include "../tpp_checks.h"
#include "tpp_kernels.cuh"

namespace chunkattn {
namespace {

// A device attribute, read once per device (fallback when the runtime cannot tell).
template <cudaDeviceAttr kAttr>
int device_attribute(int device, int fallback) {
  static int cache[64] = {};
  if (device < 0 || device >= 64) device = 0;
  if (cache[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, kAttr, device) != cudaSuccess || n <= 0) n = fallback;
    cache[device] = n;
  }
  return cache[device];
}

int sm_count(int device) { return device_attribute<cudaDevAttrMultiProcessorCount>(device, 100); }

// The partial kernel's dynamic shared memory for a head size, and what the device can give a
// block: head 256 needs ~100 KB, over the 99 KB of sm_86/89/120 (A10, L4, RTX 30-50). 0: unknown.
int partial_smem_bytes(int head_size) {
  switch (head_size) {
    case 64: return TileShape<64>::smem_bytes(kMaxRows);
    case 128: return TileShape<128>::smem_bytes(kMaxRows);
    default: return TileShape<256>::smem_bytes(kMaxRows);
  }
}

int smem_optin_bytes(int device) {
  return device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device, 0);
}

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : 0;
}

int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

void check_device(const at::Tensor& t, const char* name, const at::Tensor& query) {
  TORCH_CHECK(t.device() == query.device(), "tpp_decode: ", name, " must be on ", query.device(), ", got ",
              t.device());
}

void tpp_decode_cuda(const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const at::Tensor& node_block_indptr,
                     const at::Tensor& node_block_ids, const at::Tensor& node_seq_indptr,
                     const at::Tensor& node_seq_ids, const at::Tensor& seq_partial_indptr,
                     const at::Tensor& seq_partial_ids, const at::Tensor& seq_num_shared_blocks,
                     const at::Tensor& partial_o, const at::Tensor& partial_m,
                     const at::Tensor& partial_l, double scale, const at::Tensor& out,
                     const std::optional<at::Tensor>& lse) {
  // The contract every device shares (csrc/tpp_checks.h): shapes, dtypes, strides. The plan's
  // index ranges are checked on the host where the plan is built (chunkattn::tpp_check_plan, run
  // by vllm_chunkattn/plan.py once per step): reading them here would sync every layer.
  const TppSizes s = check_tpp_args(query, key_cache, value_cache, block_table, seq_lens, node_block_indptr,
                                    node_block_ids, node_seq_indptr, node_seq_ids, seq_partial_indptr,
                                    seq_partial_ids, seq_num_shared_blocks, partial_o, partial_m, partial_l,
                                    out, lse);
  // What the tensor-core kernel adds: fp16/bf16, its head sizes, one device, 16-byte rows.
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "tpp_decode: the CUDA TPP kernel takes fp16/bf16 query (tensor cores), got ", dtype,
              "; use kernel='reference' for fp32");
  TORCH_CHECK(key_cache.scalar_type() == dtype && out.scalar_type() == dtype, "tpp_decode: key_cache and out must "
              "have the query's dtype ", dtype, " on CUDA, got ", key_cache.scalar_type(), " and ", out.scalar_type());
  TORCH_CHECK(s.head_size == 64 || s.head_size == 128 || s.head_size == 256,
              "tpp_decode: head_size must be 64, 128 or 256 on CUDA, got ", s.head_size);
  TORCH_CHECK(s.block_size > 0 && (s.block_size & (s.block_size - 1)) == 0,
              "tpp_decode: block_size must be a power of two on CUDA, got ", s.block_size);
  for (auto [t, name] : {std::pair{&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                         {&block_table, "block_table"}, {&seq_lens, "seq_lens"},
                         {&node_block_indptr, "node_block_indptr"}, {&node_block_ids, "node_block_ids"},
                         {&node_seq_indptr, "node_seq_indptr"}, {&node_seq_ids, "node_seq_ids"},
                         {&seq_partial_indptr, "seq_partial_indptr"}, {&seq_partial_ids, "seq_partial_ids"},
                         {&seq_num_shared_blocks, "seq_num_shared_blocks"}, {&partial_o, "partial_o"},
                         {&partial_m, "partial_m"}, {&partial_l, "partial_l"}, {&out, "out"}})
    check_device(*t, name, query);
  if (lse.has_value()) check_device(*lse, "lse", query);
  TORCH_CHECK(query.stride(0) % 8 == 0 && query.stride(1) % 8 == 0 && aligned16(query),
              "tpp_decode: query strides must be multiples of 8 elements and its data 16-byte aligned on CUDA");
  for (const at::Tensor* t : {&key_cache, &value_cache})
    TORCH_CHECK(t->stride(3) == 1 && t->stride(0) % 8 == 0 && t->stride(1) % 8 == 0 && t->stride(2) % 8 == 0 &&
                    aligned16(*t),
                "tpp_decode: key_cache and value_cache must be dense in head_size (flash layout), other strides "
                "multiples of 8 elements, data 16-byte aligned on CUDA, got strides ", t->strides());
  TORCH_CHECK(out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0,
              "tpp_decode: out strides must be even and its data 4-byte aligned on CUDA");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(partial_o.data_ptr()) % 8 == 0,
              "tpp_decode: partial_o's data must be 8-byte aligned on CUDA (read as float2)");
  {
    const int need = partial_smem_bytes(s.head_size), have = smem_optin_bytes(query.get_device());
    TORCH_CHECK(have == 0 || need <= have, "tpp_decode: head_size ", s.head_size, " needs ", need,
                " bytes of shared memory per block; this GPU allows ", have,
                ". Serve this model without --attention-backend CUSTOM on this GPU.");
  }
  const int64_t slots = std::min({partial_o.size(0), partial_m.size(0), partial_l.size(0)});
  TORCH_CHECK(slots * s.num_heads < (int64_t(1) << 31), "tpp_decode: partial workspace too large for int32 indexing");
  const int num_seqs = s.num_seqs, num_heads = s.num_heads, head_size = s.head_size;
  const int block_size = s.block_size, num_kv_heads = s.num_kv_heads, num_nodes = s.num_nodes;
  const int64_t num_partials = s.num_partials;
  if (num_seqs == 0) return;

  const c10::cuda::CUDAGuard guard(query.device());
  TppParams p{};
  p.query = query.data_ptr();
  p.q_stride_seq = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.key = key_cache.data_ptr();
  p.k_stride_block = key_cache.stride(0);
  p.k_stride_tok = key_cache.stride(1);
  p.k_stride_head = key_cache.stride(2);
  p.value = value_cache.data_ptr();
  p.v_stride_block = value_cache.stride(0);
  p.v_stride_tok = value_cache.stride(1);
  p.v_stride_head = value_cache.stride(2);
  p.block_table = block_table.data_ptr<int>();
  p.bt_stride = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int>();
  p.node_block_indptr = node_block_indptr.data_ptr<int>();
  p.node_block_ids = node_block_ids.data_ptr<int>();
  p.node_seq_indptr = node_seq_indptr.data_ptr<int>();
  p.node_seq_ids = node_seq_ids.data_ptr<int>();
  p.seq_partial_indptr = seq_partial_indptr.data_ptr<int>();
  p.seq_partial_ids = seq_partial_ids.data_ptr<int>();
  p.seq_num_shared_blocks = seq_num_shared_blocks.data_ptr<int>();
  p.partial_o = partial_o.data_ptr<float>();
  p.partial_m = partial_m.data_ptr<float>();
  p.partial_l = partial_l.data_ptr<float>();
  p.out = out.data_ptr();
  p.out_stride_seq = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  p.lse_stride_seq = lse.has_value() ? lse->stride(0) : 0;
  p.lse_stride_head = lse.has_value() ? lse->stride(1) : 0;
  p.num_seqs = num_seqs;
  p.num_nodes = num_nodes;
  p.num_partials = int(num_partials);
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.group = num_heads / num_kv_heads;
  p.block_size_log2 = __builtin_ctz(block_size);
  p.scale_log2 = float(scale) * kLog2e;

  // Rows of a chunk CTA: chunk_seqs sharers x chunk_heads q heads of the group (<= 64).
  p.chunk_heads = std::min(p.group, kMaxRows);
  p.chunk_head_tiles = ceil_div(p.group, p.chunk_heads);
  p.chunk_seqs = kMaxRows / p.chunk_heads;
  p.num_windows = num_nodes == 0 ? 0 : num_nodes + ceil_div(num_partials, p.chunk_seqs);
  p.seq_heads = std::min(p.group, kSeqHeads);
  p.seq_head_tiles = ceil_div(p.group, p.seq_heads);

  // KV splits: enough CTAs for ~2 per SM, no split under ~256 (node) / 512 (tail) tokens, and
  // only as many as the workspace's spare slots hold. The tail length is bounded by the block
  // table's width (the only host-side bound). CHUNKATTN_{CHUNK,SEQ}_SPLITS override (tests).
  const int target = 2 * sm_count(query.get_device());
  int cs = 1, ss = 1;
  if (num_nodes > 0) {
    const int64_t ctas = int64_t(num_nodes + num_partials / p.chunk_seqs) * p.chunk_head_tiles * num_kv_heads;
    const int64_t avg_tokens = node_block_ids.size(0) * int64_t(block_size) / num_nodes;
    cs = int(std::max<int64_t>(1, std::min<int64_t>({ceil_div(target, ctas), 16, avg_tokens / 256})));
  }
  const int64_t seq_ctas = int64_t(num_seqs) * p.seq_head_tiles * num_kv_heads;
  const int64_t max_tail = block_table.size(1) * int64_t(block_size);
  ss = int(std::max<int64_t>(1, std::min<int64_t>({ceil_div(target, seq_ctas), 16, max_tail / 512})));
  if (env_int("CHUNKATTN_CHUNK_SPLITS") > 0) cs = env_int("CHUNKATTN_CHUNK_SPLITS");
  if (env_int("CHUNKATTN_SEQ_SPLITS") > 0) ss = env_int("CHUNKATTN_SEQ_SPLITS");
  while (int64_t(cs) * num_partials + int64_t(num_seqs) * (ss - 1) > slots) {
    if (ss > 1) --ss;
    else --cs;  // cs == 1 always fits: slots >= num_partials
  }
  p.chunk_splits = cs;
  p.seq_splits = ss;

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(query.get_device()).stream();
  cudaError_t err = cudaSuccess;
  const bool half = dtype == at::kHalf;
  switch (head_size) {
    case 64: err = half ? launch_tpp_decode<__half, 64>(p, stream) : launch_tpp_decode<__nv_bfloat16, 64>(p, stream); break;
    case 128: err = half ? launch_tpp_decode<__half, 128>(p, stream) : launch_tpp_decode<__nv_bfloat16, 128>(p, stream); break;
    default: err = half ? launch_tpp_decode<__half, 256>(p, stream) : launch_tpp_decode<__nv_bfloat16, 256>(p, stream); break;
  }
  TORCH_CHECK(err == cudaSuccess, "chunkattn::tpp_decode CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace chunkattn

TORCH_LIBRARY_IMPL(chunkattn, CUDA, m) { m.impl("tpp_decode", &chunkattn::tpp_decode_cuda); }
