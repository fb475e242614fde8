// The one inner operation of both TPP phases, framework-free: many query rows of one kv head
// attend to a run of paged KV tokens, producing unnormalised (o, m, l) softmax states.
// Implemented once per ISA (attend_*.cpp, each compiled for its own target) and chosen at run time
// by tpp_decode.cpp, so one binary runs on any x86-64 CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace chunkattn_cpu {

// fp8: the cache holds K / k_scale and V / v_scale; the caller folds k_scale into `scale` and
// v_scale into the normalisation, so the kernels read the fp8 values as they are (e4m3 times
// 2^-8, which the caller's scales undo: attend_impl.h, to_f32).
enum class KvDtype : int { kFloat32, kFloat16, kBFloat16, kFp8E4m3, kFp8E5m2 };

// One of key_cache / value_cache as [num_blocks, block_size, num_kv_heads, head_size], strides in
// elements. K is read with token_stride == 1 (CPU_ATTN, K^T per block and head) or
// dim_stride == 1 (flash); V always with dim_stride == 1. amx_packed: CPU_ATTN's AMX layout
// (bf16 pair tiles per (block, head) slab, csrc/tpp_checks.h), read by the bf16 kernels only;
// token_stride and dim_stride are then unused.
struct KvCacheView {
  const void* data;
  int64_t block_stride, token_stride, head_stride, dim_stride;
  bool amx_packed;
};

struct AttendArgs {
  KvCacheView k, v;
  KvDtype dtype;
  int block_size;
  int kv_head;
  const int32_t* block_ids;  // blocks covering num_tokens, in token order (last may be partial)
  int num_tokens;            // may be 0: the state is then empty (o = 0, m = -inf, l = 0)
  const void* q;             // [num_rows, head_size] dense: bf16 for the *_bf16 kernel, else fp32
  int num_rows;
  float scale;
  float soft_cap;            // > 0: a scaled score s becomes soft_cap * tanh(s / soft_cap)
  // Sliding window: the rows of the call's sequence k (row r / rows_per_seq) do not see the run's
  // keys before first_key[k] (their window's edge; may be <= 0 or >= num_tokens). nullptr: no
  // window.
  const int32_t* first_key;
  // Output state of row r lives at o + (r / rows_per_seq) * o_seq_stride + (r % rows_per_seq) *
  // head_size, and m/l + (r / rows_per_seq) * ml_seq_stride + r % rows_per_seq: the GQA group of
  // one sequence is contiguous, sequences are strided (the partial_o/m/l workspace layout).
  float* o;
  float* m;
  float* l;
  int rows_per_seq;
  int64_t o_seq_stride, ml_seq_stride;
};

using AttendFn = void (*)(const AttendArgs&);

// Each returns nullptr for a head size it was not built for. The caller checks the CPU first.
// x86-64 only:
AttendFn attend_avx512_bf16(int head_size);  // bf16 KV + bf16 q, block_size % 16 == 0
AttendFn attend_amx(int head_size);          // as avx512_bf16, on AMX tiles; nullptr unless the
                                             // CPU has AMX-BF16 and the OS grants its use
AttendFn attend_avx512(int head_size);       // any KV dtype (fp8 too), fp32 q
AttendFn attend_avx2(int head_size);
// Any CPU:
AttendFn attend_scalar(int head_size);

// The bf16 kernels' per-thread scratch of at least `words` 32-bit words, 64-byte aligned, grown
// on demand (a packed chunk is too big for a worker thread's stack at head 256); the AMX and
// AVX512_BF16 kernels share it. Defined in attend_avx512_bf16.cpp.
uint32_t* bf16_scratch(size_t words);

}  // namespace chunkattn_cpu
