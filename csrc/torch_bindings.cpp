// Every schema of torch.ops.chunkattn lives here; csrc/cpu, csrc/cuda and csrc/tpp_checks.cpp
// register implementations for their own dispatch key only. The empty PyInit__C lets `import vllm_chunkattn._C` load the library.
#include <Python.h>
#include <torch/library.h>

#include "tpp_schema.h"

TORCH_LIBRARY(chunkattn, m) {
  // TPP decode over a paged KV cache (see vllm_chunkattn/plan for the plan tensors).
  // partial_o/m/l: fp32 workspace [>= num_partials, num_heads(, head_size)], overwritten.
  // out: [num_seqs, num_heads, head_size] written in place; lse: optional natural-log LSE.
  m.def("tpp_decode(" CHUNKATTN_TPP_DECODE_ARGS ") -> ()");
  // The plan checks of tpp_decode on host tensors (csrc/tpp_checks.h), once per step, for a plan
  // about to be copied to a device whose op checks only shapes.
  m.def(
      "tpp_check_plan(Tensor block_table, Tensor seq_lens, Tensor node_block_indptr, "
      "Tensor node_block_ids, Tensor node_seq_indptr, Tensor node_seq_ids, "
      "Tensor seq_partial_indptr, Tensor seq_partial_ids, Tensor seq_num_shared_blocks, "
      "Tensor node_first_block, int num_blocks, int block_size) -> ()");
}

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
