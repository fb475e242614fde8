// The arguments of chunkattn::tpp_decode (schema: tpp_schema.h) as one struct, TppArgs, made in
// one place, tpp_decode_entry: the function every device registers for the op. The checks
// (tpp_checks.h), the CPU op, the CUDA op and its CPU emulation all take a TppArgs, so the
// op's C++ argument list is written here only. Members refer to the call's own arguments: a
// TppArgs lives as long as the call.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "tpp_plan_arrays.h"

namespace chunkattn {

// The block table, seq_lens and the plan's eight tensors (vllm_chunkattn/plan), all int32.
struct TppPlanTensors {
  const at::Tensor& block_table;            // [num_seqs, max_blocks]
  const at::Tensor& seq_lens;               // [num_seqs]
  const at::Tensor& node_block_indptr;      // [num_nodes + 1] into node_block_ids
  const at::Tensor& node_block_ids;         // the shared nodes' KV blocks
  const at::Tensor& node_seq_indptr;        // [num_nodes + 1] into node_seq_ids
  const at::Tensor& node_seq_ids;           // [num_partials]: the row of each (node, row) partial
  const at::Tensor& seq_partial_indptr;     // [num_seqs + 1] into seq_partial_ids
  const at::Tensor& seq_partial_ids;        // [num_partials]: each row's partials
  const at::Tensor& seq_num_shared_blocks;  // [num_seqs]: where each row's private tail starts
  const at::Tensor& node_first_block;       // [num_nodes]: the block (of every sharer) a node starts at

  // f(tensor, its argument name), in the schema's order.
  template <typename F>
  void for_each(F&& f) const {
    f(block_table, "block_table");
    f(seq_lens, "seq_lens");
    f(node_block_indptr, "node_block_indptr");
    f(node_block_ids, "node_block_ids");
    f(node_seq_indptr, "node_seq_indptr");
    f(node_seq_ids, "node_seq_ids");
    f(seq_partial_indptr, "seq_partial_indptr");
    f(seq_partial_ids, "seq_partial_ids");
    f(seq_num_shared_blocks, "seq_num_shared_blocks");
    f(node_first_block, "node_first_block");
  }
};

struct TppArgs {
  const at::Tensor& query;        // [num_seqs, num_heads, head_size]
  const at::Tensor& key_cache;    // [num_blocks, block_size, num_kv_heads, head_size]
  const at::Tensor& value_cache;  // as key_cache
  TppPlanTensors plan;
  // fp32 workspace [>= num_partials, num_heads(, head_size)], overwritten.
  const at::Tensor& partial_o;
  const at::Tensor& partial_m;
  const at::Tensor& partial_l;
  double scale;
  const at::Tensor& out;                 // [num_seqs, num_heads, head_size], written in place
  const std::optional<at::Tensor>& lse;  // [num_seqs, num_heads] natural-log LSE, if given
  // The layer's attention variant (tpp_schema.h): 0 / 0 / none is plain causal attention.
  int64_t sliding_window;
  double soft_cap;
  const std::optional<at::Tensor>& sinks;  // fp32 [num_heads]
  // fp8 KV caches: K = k_scale * key_cache, V = v_scale * value_cache (tpp_schema.h).
  double k_scale;
  double v_scale;

  // f(tensor, its argument name) for every tensor of the call (lse where given), in the schema's
  // order.
  template <typename F>
  void for_each_tensor(F&& f) const {
    f(query, "query");
    f(key_cache, "key_cache");
    f(value_cache, "value_cache");
    plan.for_each(f);
    f(partial_o, "partial_o");
    f(partial_m, "partial_m");
    f(partial_l, "partial_l");
    f(out, "out");
    if (lse.has_value()) f(*lse, "lse");
    if (sinks.has_value()) f(*sinks, "sinks");
  }
};

// The pointers of a call's plan tensors, in host or device memory as the tensors are.
inline PlanArrays plan_arrays(const TppPlanTensors& t) {
  return {t.block_table.data_ptr<int32_t>(),        t.block_table.stride(0),
          t.seq_lens.data_ptr<int32_t>(),           t.node_block_indptr.data_ptr<int32_t>(),
          t.node_block_ids.data_ptr<int32_t>(),     t.node_seq_indptr.data_ptr<int32_t>(),
          t.node_seq_ids.data_ptr<int32_t>(),       t.seq_partial_indptr.data_ptr<int32_t>(),
          t.seq_partial_ids.data_ptr<int32_t>(),    t.seq_num_shared_blocks.data_ptr<int32_t>(),
          t.node_first_block.data_ptr<int32_t>()};
}

// The op's C++ signature, the schema's arguments in its order: what a device registers, as
// &tpp_decode_entry<&its_impl>. Calls impl(TppArgs, extra...); `Extra`: arguments a test op
// appends to the schema's (the CPU emulation of the CUDA op).
template <auto Impl, typename... Extra>
void tpp_decode_entry(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& block_table, const at::Tensor& seq_lens,
                      const at::Tensor& node_block_indptr, const at::Tensor& node_block_ids,
                      const at::Tensor& node_seq_indptr, const at::Tensor& node_seq_ids,
                      const at::Tensor& seq_partial_indptr, const at::Tensor& seq_partial_ids,
                      const at::Tensor& seq_num_shared_blocks, const at::Tensor& node_first_block,
                      const at::Tensor& partial_o, const at::Tensor& partial_m, const at::Tensor& partial_l,
                      double scale, const at::Tensor& out, const std::optional<at::Tensor>& lse,
                      int64_t sliding_window, double soft_cap, const std::optional<at::Tensor>& sinks,
                      double k_scale, double v_scale, Extra... extra) {
  Impl(TppArgs{query,
               key_cache,
               value_cache,
               {block_table, seq_lens, node_block_indptr, node_block_ids, node_seq_indptr, node_seq_ids,
                seq_partial_indptr, seq_partial_ids, seq_num_shared_blocks, node_first_block},
               partial_o,
               partial_m,
               partial_l,
               scale,
               out,
               lse,
               sliding_window,
               soft_cap,
               sinks,
               k_scale,
               v_scale},
       extra...);
}

}  // namespace chunkattn
