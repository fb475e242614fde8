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
//             that fits. Padded rows come out as 0 with lse = -inf.
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

#include "tpp_kernels.cuh"

namespace chunkattn {
namespace {

int sm_count(int device) {
  static int cache[64] = {};
  if (device < 0 || device >= 64) device = 0;
  if (cache[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0)
      n = 100;
    cache[device] = n;
  }
  return cache[device];
}

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : 0;
}

int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

void check_kv(const at::Tensor& t, const char* name, const at::Tensor& query) {
  TORCH_CHECK(t.dim() == 4, name, ": expected [num_blocks, block_size, num_kv_heads, head_size]");
  TORCH_CHECK(t.device() == query.device(), name, ": expected on ", query.device());
  TORCH_CHECK(t.scalar_type() == query.scalar_type(), name, ": expected dtype ",
              query.scalar_type(), " (same as query), got ", t.scalar_type());
  TORCH_CHECK(t.stride(3) == 1, name, ": head_size dim must be dense (stride 1)");
  TORCH_CHECK(t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              name, ": strides must be multiples of 8 elements and data 16-byte aligned");
}

void check_index(const at::Tensor& t, const char* name, const at::Tensor& query) {
  TORCH_CHECK(t.scalar_type() == at::kInt, name, ": expected int32, got ", t.scalar_type());
  TORCH_CHECK(t.device() == query.device(), name, ": expected on ", query.device());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), name, ": expected a contiguous 1-d tensor");
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
  TORCH_CHECK(query.is_cuda() && query.dim() == 3, "query: expected [num_seqs, num_heads, head_size] on CUDA");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "query: the CUDA TPP kernel takes fp16/bf16 (tensor cores), got ", dtype,
              "; use kernel='reference' for fp32");
  const int num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  TORCH_CHECK(head_size == 64 || head_size == 128 || head_size == 256,
              "query: head_size must be 64, 128 or 256, got ", head_size);
  TORCH_CHECK(query.stride(2) == 1 && query.stride(0) % 8 == 0 && query.stride(1) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(query.data_ptr()) % 16 == 0,
              "query: last dim must be dense, other strides multiples of 8, data 16-byte aligned");
  check_kv(key_cache, "key_cache", query);
  check_kv(value_cache, "value_cache", query);
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "value_cache: expected the shape of key_cache");
  const int block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_size, "key_cache: head_size ", key_cache.size(3),
              " != query head_size ", head_size);
  TORCH_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0,
              "key_cache: block_size must be a power of two, got ", block_size);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads (", num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.size(0) >= num_seqs && block_table.stride(1) == 1 &&
                  block_table.device() == query.device(),
              "block_table: expected int32 [num_seqs, max_blocks] with dense rows on ", query.device());
  check_index(seq_lens, "seq_lens", query);
  check_index(node_block_indptr, "node_block_indptr", query);
  check_index(node_block_ids, "node_block_ids", query);
  check_index(node_seq_indptr, "node_seq_indptr", query);
  check_index(node_seq_ids, "node_seq_ids", query);
  check_index(seq_partial_indptr, "seq_partial_indptr", query);
  check_index(seq_partial_ids, "seq_partial_ids", query);
  check_index(seq_num_shared_blocks, "seq_num_shared_blocks", query);
  TORCH_CHECK(seq_lens.size(0) >= num_seqs && seq_partial_indptr.size(0) >= num_seqs + 1 &&
                  seq_num_shared_blocks.size(0) >= num_seqs,
              "seq_lens / seq_partial_indptr / seq_num_shared_blocks: too short for ", num_seqs, " rows");
  const int num_nodes = node_seq_indptr.size(0) - 1;
  TORCH_CHECK(num_nodes >= 0 && node_block_indptr.size(0) == num_nodes + 1,
              "node_block_indptr and node_seq_indptr: expected [num_nodes + 1] each");
  const int64_t num_partials = node_seq_ids.size(0);
  const int64_t slots = std::min({partial_o.size(0), partial_m.size(0), partial_l.size(0)});
  for (const at::Tensor* t : {&partial_o, &partial_m, &partial_l})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device() == query.device(),
                "partial_o/m/l: expected contiguous fp32 on ", query.device());
  TORCH_CHECK(partial_o.dim() == 3 && partial_o.size(1) == num_heads && partial_o.size(2) == head_size &&
                  partial_m.dim() == 2 && partial_m.size(1) == num_heads && partial_l.dim() == 2 &&
                  partial_l.size(1) == num_heads,
              "partial_o: expected [slots, num_heads, head_size], partial_m/l [slots, num_heads]");
  TORCH_CHECK(slots >= num_partials, "partial_o/m/l: ", slots, " rows < num_partials ", num_partials);
  TORCH_CHECK(slots * num_heads < (int64_t(1) << 31), "partial workspace too large for int32 indexing");
  TORCH_CHECK(out.scalar_type() == dtype && out.device() == query.device() && out.dim() == 3 &&
                  out.size(0) == num_seqs && out.size(1) == num_heads && out.size(2) == head_size &&
                  out.stride(2) == 1 && out.stride(1) % 2 == 0 && out.stride(0) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0,
              "out: expected ", dtype, " [num_seqs, num_heads, head_size] with a dense last dim");
  if (lse.has_value())
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->device() == query.device() &&
                    lse->dim() == 2 && lse->size(0) == num_seqs && lse->size(1) == num_heads,
                "lse: expected fp32 [num_seqs, num_heads]");
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
