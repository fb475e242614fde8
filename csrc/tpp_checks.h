// The contract of chunkattn::tpp_decode, written once for every device: the CPU op
// (csrc/cpu/tpp_decode.cpp), the CUDA op (csrc/cuda/tpp_decode.cu) and the host plan check op
// (csrc/tpp_checks.cpp) call these, so a bad call fails with the same message everywhere.
//   check_tpp_args: the scale, shapes, dtypes, strides. Reads no tensor data, so it is free on CUDA.
//   check_tpp_plan: the plan's indices stay inside the cache, the block table and the workspace.
//     Reads the plan through host pointers: the CPU op runs it on every call; for CUDA the builder
//     runs it once per step on the host plan, before the copy to the device (reading the device
//     copy here would be a host sync per layer).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <utility>

#include "tpp_args.h"

namespace chunkattn {

struct TppSizes {
  int64_t num_seqs, num_heads, head_size, num_blocks, block_size, num_kv_heads;
  int64_t num_nodes, num_partials;
  bool kv_amx_packed;  // the caches are 6-D views of CPU_ATTN's AMX layout (kv_amx_sizes)
};

inline void check_index(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.scalar_type() == at::kInt, "tpp_decode: ", name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dims, "tpp_decode: ", name, " must have ", dims, " dims, got ", t.dim());
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, "tpp_decode: ", name, " must be dense in its last dim");
  TORCH_CHECK(dims == 1 || t.numel() == 0 || t.stride(0) >= t.size(1), "tpp_decode: ", name, " rows overlap");
}

// The block table, seq_lens and the eight plan tensors of a batch of num_seqs rows.
// Returns {num_nodes, num_partials}.
inline std::pair<int64_t, int64_t> check_plan_tensors(int64_t num_seqs, const TppPlanTensors& plan) {
  plan.for_each([&plan](const at::Tensor& t, const char* name) {
    check_index(t, name, &t == &plan.block_table ? 2 : 1);  // the one 2-D tensor
  });
  TORCH_CHECK(plan.block_table.size(0) == num_seqs && plan.seq_lens.size(0) == num_seqs &&
                  plan.seq_num_shared_blocks.size(0) == num_seqs && plan.seq_partial_indptr.size(0) == num_seqs + 1,
              "tpp_decode: block_table, seq_lens, seq_num_shared_blocks and seq_partial_indptr must have "
              "num_seqs (+1) = ", num_seqs, " rows");
  const int64_t num_nodes = plan.node_block_indptr.size(0) - 1;
  const int64_t num_partials = plan.node_seq_ids.size(0);
  TORCH_CHECK(num_nodes >= 0 && plan.node_seq_indptr.size(0) == num_nodes + 1 &&
                  plan.node_first_block.size(0) == num_nodes,
              "tpp_decode: node_block_indptr and node_seq_indptr must both have num_nodes + 1 entries, "
              "node_first_block num_nodes");
  TORCH_CHECK(plan.seq_partial_ids.size(0) == num_partials, "tpp_decode: seq_partial_ids and node_seq_ids must "
              "both have num_partials entries");
  return {num_nodes, num_partials};
}

// CPU_ATTN's AMX layout (bf16; vllm_chunkattn/kv_layout.py), as 6-D strided views of each
// (block, kv head) slab, K then V:
//   key_cache   [num_blocks, block_size / 16, 16, num_kv_heads, head_size / 2, 2]: 16-token
//               groups of [head_size / 2][16] dim pairs (the B tiles of Q.K^T)
//   value_cache [num_blocks, block_size / 2, 2, num_kv_heads, head_size / 16, 16]: 16-dim groups
//               of [block_size / 2][16] token pairs (the B tiles of P.V)
inline void check_kv_amx_layout(const at::Tensor& k, const at::Tensor& v, TppSizes& s) {
  TORCH_CHECK(v.dim() == 6 && k.size(2) == 16 && k.size(5) == 2 && v.size(2) == 2 && v.size(5) == 16,
              "tpp_decode: 6-D caches must be views of CPU_ATTN's AMX layout, got ", k.sizes(), " and ", v.sizes());
  s.num_blocks = k.size(0);
  s.block_size = k.size(1) * 16;
  s.num_kv_heads = k.size(3);
  const int64_t d = k.size(4) * 2, n = s.block_size;
  TORCH_CHECK(d == s.head_size && v.size(4) * 16 == d && v.size(1) * 2 == n && v.size(0) == s.num_blocks &&
                  v.size(3) == s.num_kv_heads,
              "tpp_decode: AMX-layout caches ", k.sizes(), " and ", v.sizes(), " do not match head_size ",
              s.head_size);
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 && n % 32 == 0 && d % 32 == 0,
              "tpp_decode: CPU_ATTN's AMX layout holds bf16 with block_size and head_size multiples of 32");
  TORCH_CHECK(k.stride(5) == 1 && k.stride(2) == 2 && k.stride(4) == 32 && k.stride(1) == 16 * d &&
                  v.stride(2) == 1 && v.stride(5) == 2 && v.stride(1) == 32 && v.stride(4) == 16 * n &&
                  v.stride(0) == k.stride(0) && v.stride(3) == k.stride(3),
              "tpp_decode: AMX-layout cache strides ", k.strides(), " and ", v.strides(),
              " are not CPU_ATTN's");
}

inline TppSizes check_tpp_args(const TppArgs& a) {
  // Positive: the CUDA kernels take each row's max of the unscaled scores and scale it alone
  // (tpp_attend_tile.cuh, mask_and_max), which a negative scale would turn into the min.
  TORCH_CHECK(a.scale > 0 && std::isfinite(a.scale), "tpp_decode: scale must be positive and finite, got ", a.scale);
  const at::Tensor &query = a.query, &key_cache = a.key_cache, &value_cache = a.value_cache;
  TORCH_CHECK(query.dim() == 3, "tpp_decode: query must be [num_seqs, num_heads, head_size], got ", query.sizes());
  TppSizes s{};
  s.num_seqs = query.size(0);
  s.num_heads = query.size(1);
  s.head_size = query.size(2);
  s.kv_amx_packed = key_cache.dim() == 6;
  if (s.kv_amx_packed) {
    check_kv_amx_layout(key_cache, value_cache, s);
  } else {
    TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
                "tpp_decode: key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
                "head_size] (or 6-D views of CPU_ATTN's AMX layout), got ", key_cache.sizes(), " and ",
                value_cache.sizes());
    s.num_blocks = key_cache.size(0);
    s.block_size = key_cache.size(1);
    s.num_kv_heads = key_cache.size(2);
    TORCH_CHECK(key_cache.size(3) == s.head_size, "tpp_decode: key_cache head_size ", key_cache.size(3),
                " != query head_size ", s.head_size);
  }
  TORCH_CHECK(s.num_kv_heads > 0 && s.num_heads % s.num_kv_heads == 0, "tpp_decode: num_heads ", s.num_heads,
              " must be a multiple of num_kv_heads ", s.num_kv_heads);
  auto is_float = [](at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; };
  auto is_fp8 = [](at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; };
  for (const at::Tensor* t : {&query, &a.out})
    TORCH_CHECK(is_float(t->scalar_type()),
                "tpp_decode: query and out must be float32, float16 or bfloat16, got ", t->scalar_type());
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "tpp_decode: value_cache dtype ",
              value_cache.scalar_type(), " != key_cache dtype ", key_cache.scalar_type());
  TORCH_CHECK(is_float(key_cache.scalar_type()) || is_fp8(key_cache.scalar_type()),
              "tpp_decode: key_cache dtype must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, got ",
              key_cache.scalar_type());
  TORCH_CHECK(a.k_scale > 0 && std::isfinite(a.k_scale) && a.v_scale > 0 && std::isfinite(a.v_scale),
              "tpp_decode: k_scale and v_scale must be finite and > 0, got ", a.k_scale, " and ", a.v_scale);
  TORCH_CHECK(query.stride(2) == 1, "tpp_decode: query must be dense in head_size");
  TORCH_CHECK(a.out.sizes() == query.sizes() && a.out.stride(2) == 1,
              "tpp_decode: out must be [num_seqs, num_heads, head_size] dense in head_size, got ", a.out.sizes());
  TORCH_CHECK(s.kv_amx_packed || key_cache.stride(3) == 1 || key_cache.stride(1) == 1,
              "tpp_decode: key_cache must have head_size stride 1 (flash layout) or block_size stride 1 "
              "(CPU_ATTN layout, K^T per block and head), got strides ", key_cache.strides());
  TORCH_CHECK(s.kv_amx_packed || value_cache.stride(3) == 1,
              "tpp_decode: value_cache must have head_size stride 1, got strides ", value_cache.strides());
  std::tie(s.num_nodes, s.num_partials) = check_plan_tensors(s.num_seqs, a.plan);
  const at::Tensor& partial_o = a.partial_o;
  TORCH_CHECK(partial_o.scalar_type() == at::kFloat && partial_o.is_contiguous() && partial_o.dim() == 3 &&
                  partial_o.size(0) >= s.num_partials && partial_o.size(1) == s.num_heads &&
                  partial_o.size(2) == s.head_size,
              "tpp_decode: partial_o must be contiguous float32 [>= ", s.num_partials, ", ", s.num_heads, ", ",
              s.head_size, "], got ", partial_o.scalar_type(), " ", partial_o.sizes());
  for (const at::Tensor* t : {&a.partial_m, &a.partial_l})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) >= s.num_partials && t->size(1) == s.num_heads,
                "tpp_decode: partial_m and partial_l must be contiguous float32 [>= ", s.num_partials, ", ",
                s.num_heads, "], got ", t->sizes());
  TORCH_CHECK(a.sliding_window >= 0, "tpp_decode: sliding_window must be >= 0 (0: none), got ", a.sliding_window);
  TORCH_CHECK(a.soft_cap >= 0 && std::isfinite(a.soft_cap), "tpp_decode: soft_cap must be >= 0 (0: none), got ",
              a.soft_cap);
  if (a.sinks.has_value())
    TORCH_CHECK(a.sinks->scalar_type() == at::kFloat && a.sinks->dim() == 1 && a.sinks->size(0) == s.num_heads &&
                    a.sinks->is_contiguous() && a.sinks->device() == query.device(),
                "tpp_decode: sinks must be contiguous float32 [", s.num_heads, "] on the query's device, got ", a.sinks->scalar_type(), " ",
                a.sinks->sizes());
  if (a.lse.has_value())
    TORCH_CHECK(a.lse->scalar_type() == at::kFloat && a.lse->dim() == 2 && a.lse->size(0) == s.num_seqs &&
                    a.lse->size(1) == s.num_heads,
                "tpp_decode: lse must be float32 [", s.num_seqs, ", ", s.num_heads, "], got ", a.lse->sizes());
  return s;
}

// A CSR offsets array: starts at 0, never decreases, ends at `total`.
inline void check_indptr(const int32_t* p, int64_t n, int64_t total, const char* name) {
  TORCH_CHECK(p[0] == 0 && p[n] == total, "tpp_decode: ", name, " must run from 0 to ", total);
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(p[i] <= p[i + 1], "tpp_decode: ", name, " decreases at ", i);
}

inline void check_range(const int32_t* p, int64_t n, int64_t hi, const char* name) {
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < hi, "tpp_decode: ", name, "[", i, "] = ", p[i], " not in [0, ", hi, ")");
}

// Every index the kernels follow, O(plan size + blocks in the rows' private tails). The tensors
// are host tensors that passed check_plan_tensors for num_seqs rows.
inline void check_tpp_plan(int64_t num_blocks, int64_t block_size, const TppPlanTensors& plan) {
  const int64_t num_seqs = plan.seq_lens.size(0), num_nodes = plan.node_block_indptr.size(0) - 1;
  const int64_t num_partials = plan.node_seq_ids.size(0), num_node_blocks = plan.node_block_ids.size(0);
  const int64_t max_blocks = plan.block_table.size(1);
  const PlanArrays p = plan_arrays(plan);
  check_indptr(p.node_block_indptr, num_nodes, num_node_blocks, "node_block_indptr");
  check_indptr(p.node_seq_indptr, num_nodes, num_partials, "node_seq_indptr");
  check_indptr(p.seq_partial_indptr, num_seqs, num_partials, "seq_partial_indptr");
  check_range(p.node_block_ids, num_node_blocks, num_blocks, "node_block_ids");
  check_range(p.node_seq_ids, num_partials, num_seqs, "node_seq_ids");
  check_range(p.seq_partial_ids, num_partials, num_partials, "seq_partial_ids");
  // A node lies at the same blocks of every sharer, inside its shared prefix (the window masks
  // of the chunk-first phase are computed from it).
  for (int64_t n = 0; n < num_nodes; ++n) {
    const int64_t first = p.node_first_block[n], end = first + p.node_block_indptr[n + 1] - p.node_block_indptr[n];
    TORCH_CHECK(first >= 0, "tpp_decode: node_first_block[", n, "] = ", first, " is negative");
    for (int64_t j = p.node_seq_indptr[n]; j < p.node_seq_indptr[n + 1]; ++j)
      TORCH_CHECK(end <= p.seq_num_shared_blocks[p.node_seq_ids[j]], "tpp_decode: node ", n, " ends at block ", end,
                  ", past the shared prefix of its row ", p.node_seq_ids[j]);
  }
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int32_t len = p.seq_lens[i], shared = p.seq_num_shared_blocks[i];
    const int64_t used = (int64_t(len) + block_size - 1) / block_size;
    TORCH_CHECK(len >= 0 && used <= max_blocks, "tpp_decode: seq_lens[", i, "] = ", len,
                " needs more than the ", max_blocks, " blocks of block_table");
    TORCH_CHECK(shared >= 0 && int64_t(shared) * block_size <= len, "tpp_decode: seq_num_shared_blocks[", i,
                "] = ", shared, " exceeds seq_lens[", i, "] = ", len);
    check_range(p.block_table + i * p.bt_stride + shared, used - shared, num_blocks, "block_table row");
  }
}

}  // namespace chunkattn
