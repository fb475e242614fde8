// The plan's int32 arrays (the block table, seq_lens and the eight tensors of
// vllm_chunkattn/plan) as raw pointers, framework-free: the CPU op and the host plan check read
// them on the host (plan_arrays, tpp_args.h), the CUDA kernels on the device as part of
// TppParams (cuda/tpp_params.cuh).
#pragma once

#include <stdint.h>

namespace chunkattn {

struct PlanArrays {
  const int32_t* block_table;  // [num_seqs, max_blocks], rows bt_stride elements apart
  int64_t bt_stride;
  const int32_t* seq_lens;
  const int32_t* node_block_indptr;
  const int32_t* node_block_ids;
  const int32_t* node_seq_indptr;
  const int32_t* node_seq_ids;
  const int32_t* seq_partial_indptr;
  const int32_t* seq_partial_ids;
  const int32_t* seq_num_shared_blocks;
  const int32_t* node_first_block;
};

}  // namespace chunkattn
