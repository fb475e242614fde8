// The arguments of chunkattn::tpp_decode's schema (csrc/torch_bindings.cpp), also those of the
// CUDA op's CPU emulation (csrc/cuda_emu), which appends its own: one list, so the two stay alike.
// The same arguments in C++: TppArgs and tpp_decode_entry (tpp_args.h). The per-layer attention
// variants come last, with defaults that mean plain causal attention:
//   sliding_window > 0: a row of seq_len L sees keys [max(0, L - sliding_window), L) (vLLM's);
//   soft_cap > 0: a scaled score s becomes soft_cap * tanh(s / soft_cap) before the softmax;
//   sinks: fp32 [num_heads], one logit per head that joins each row's softmax denominator and
//     adds no value (gpt-oss); the lse then includes it.
// An fp8 KV cache (key_cache / value_cache float8_e4m3fn or float8_e5m2, views of vLLM's uint8
// cache) holds K / k_scale and V / v_scale: the kernels read K = k_scale * key_cache and
// V = v_scale * value_cache (per-tensor scales; ignored for other dtypes, 1 by default).
#pragma once

#define CHUNKATTN_TPP_DECODE_ARGS                                                       \
  "Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "           \
  "Tensor seq_lens, Tensor node_block_indptr, Tensor node_block_ids, "                 \
  "Tensor node_seq_indptr, Tensor node_seq_ids, Tensor seq_partial_indptr, "           \
  "Tensor seq_partial_ids, Tensor seq_num_shared_blocks, Tensor node_first_block, "     \
  "Tensor(a!) partial_o, Tensor(b!) partial_m, Tensor(c!) partial_l, float scale, "    \
  "Tensor(d!) out, Tensor(e!)? lse=None, int sliding_window=0, float soft_cap=0., "     \
  "Tensor? sinks=None, float k_scale=1., float v_scale=1."
