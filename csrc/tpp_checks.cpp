// chunkattn::tpp_check_plan: the plan checks of tpp_decode (tpp_checks.h) on host tensors, for
// callers that run the kernel on a device where reading the plan would cost a sync: the builder
// checks each step's host plan once, before copying it to the device (vllm_chunkattn/plan).
#include <torch/library.h>

#include "tpp_checks.h"

namespace chunkattn {
namespace {

void tpp_check_plan(const at::Tensor& block_table, const at::Tensor& seq_lens,
                    const at::Tensor& node_block_indptr, const at::Tensor& node_block_ids,
                    const at::Tensor& node_seq_indptr, const at::Tensor& node_seq_ids,
                    const at::Tensor& seq_partial_indptr, const at::Tensor& seq_partial_ids,
                    const at::Tensor& seq_num_shared_blocks, const at::Tensor& node_first_block,
                    int64_t num_blocks, int64_t block_size) {
  TORCH_CHECK(block_size > 0, "tpp_check_plan: block_size must be positive, got ", block_size);
  const TppPlanTensors plan{block_table, seq_lens, node_block_indptr, node_block_ids, node_seq_indptr,
                            node_seq_ids, seq_partial_indptr, seq_partial_ids, seq_num_shared_blocks,
                            node_first_block};
  check_plan_tensors(seq_lens.size(0), plan);
  check_tpp_plan(num_blocks, block_size, plan);
}

}  // namespace
}  // namespace chunkattn

TORCH_LIBRARY_IMPL(chunkattn, CPU, m) { m.impl("tpp_check_plan", &chunkattn::tpp_check_plan); }
