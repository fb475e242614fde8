// chunkattn::tpp_decode on CPU: argument checks, the run-time ISA choice, and the two phases over
// the plan (vllm_chunkattn/plan) as parallel loops of independent work items, each one call of
// the attend kernel (tpp_attend.h). Matches vllm_chunkattn/ops/reference.py::tpp_decode_reference.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../softmax_state.h"
#include "../tpp_checks.h"
#include "tpp_attend.h"

namespace chunkattn_cpu {
namespace {

struct Kernel {
  AttendFn fn = nullptr;
  bool q_bf16 = false;  // the kernel takes bf16 query rows, else fp32
};

// The best kernel this CPU runs. CHUNKATTN_CPU_ISA=amx|avx512_bf16|avx512|avx2|scalar restricts the
// choice to one, so tests cover the fallbacks on a machine that has them all.
Kernel choose_kernel(at::ScalarType kv_dtype, at::ScalarType q_dtype, int64_t block_size,
                     int64_t head_size, bool kv_amx_packed) {
  const char* env = std::getenv("CHUNKATTN_CPU_ISA");
  const std::string want = env ? env : "";
  auto allowed = [&](const char* name) { return want.empty() || want == name; };
  const int hs = static_cast<int>(head_size);
#if defined(__x86_64__)  // the SIMD kernels are x86-64 only
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool avx512_bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool bf16_ok = avx512_bf16 && kv_dtype == at::kBFloat16 && q_dtype == at::kBFloat16 &&
                       block_size % 16 == 0;
  if (allowed("amx") && bf16_ok) {  // attend_amx checks AMX itself (CPUID + OS permission)
    if (AttendFn fn = attend_amx(hs)) return {fn, true};
  }
  if (allowed("avx512_bf16") && bf16_ok) {
    if (AttendFn fn = attend_avx512_bf16(hs)) return {fn, true};
  }
  TORCH_CHECK(!kv_amx_packed, "tpp_decode: CPU_ATTN's AMX cache layout is read by the amx and avx512_bf16 "
              "kernels only, for bf16 query and cache",
              want.empty() ? std::string() : " (CHUNKATTN_CPU_ISA=" + want + ")");
  if (allowed("avx512") && avx512) {
    if (AttendFn fn = attend_avx512(hs)) return {fn, false};
  }
  if (allowed("avx2") && avx2) {
    if (AttendFn fn = attend_avx2(hs)) return {fn, false};
  }
#else
  (void)kv_dtype, (void)q_dtype, (void)block_size;
  TORCH_CHECK(!kv_amx_packed, "tpp_decode: CPU_ATTN's AMX cache layout is read on x86-64 only");
#endif
  if (allowed("scalar")) {
    if (AttendFn fn = attend_scalar(hs)) return {fn, false};
  }
  TORCH_CHECK(false, "tpp_decode: no CPU kernel for head_size ", head_size,
              " (supported: 64, 80, 96, 128, 256)",
              want.empty() ? std::string() : " with CHUNKATTN_CPU_ISA=" + want);
}

KvDtype kv_dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return KvDtype::kFloat32;
    case at::kHalf: return KvDtype::kFloat16;
    case at::kBFloat16: return KvDtype::kBFloat16;
    case at::kFloat8_e4m3fn: return KvDtype::kFp8E4m3;
    case at::kFloat8_e5m2: return KvDtype::kFp8E5m2;
    default: TORCH_CHECK(false, "tpp_decode: unsupported key_cache dtype ", t.scalar_type());
  }
}

KvCacheView view_of(const at::Tensor& t) {
  if (t.dim() == 6)  // CPU_ATTN's AMX layout (check_kv_amx_layout): block and head strides only
    return {t.data_ptr(), t.stride(0), 0, t.stride(3), 0, true};
  return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2), t.stride(3), false};
}

template <typename T>
void store_out_row(void* dst, const float* o, float inv_l, int64_t head_size) {
  T* d = static_cast<T*>(dst);
  for (int64_t i = 0; i < head_size; ++i) d[i] = static_cast<T>(o[i] * inv_l);
}

// Runs f1(item, thread) for the chunk-first items [0, n1), then f2(item, thread) for the
// sequence-first items [0, n2), in ONE parallel region on torch's intra-op threads (a fork/join
// wakes every thread, and on a shared machine waits for a descheduled one, once per region).
// Items go out one at a time, in ticket order (sizes differ widely, so a static split would idle
// threads): every chunk-first ticket is drawn before any sequence-first one, so a thread holding
// a sequence-first ticket waits only for chunk-first items already running elsewhere.
template <typename F1, typename F2>
void parallel_two_phases(int64_t n1, int64_t n2, int num_threads, const F1& f1, const F2& f2) {
  std::atomic<int64_t> next{0}, done1{0};
  const int64_t n = n1 + n2;
  at::parallel_for(0, std::min<int64_t>(num_threads, std::max<int64_t>(n, 1)), 1,
                   [&](int64_t, int64_t) {
                     const int tid = at::get_thread_num();
                     for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
                       if (w < n1) {
                         f1(w, tid);
                         done1.fetch_add(1, std::memory_order_release);  // partials published
                         continue;
                       }
                       while (done1.load(std::memory_order_acquire) < n1) std::this_thread::yield();
                       f2(w - n1, tid);
                     }
                   });
}

void tpp_decode_cpu(const chunkattn::TppArgs& args) {
  // ---- arguments, then the plan: it must stay inside the cache and the workspace (O(plan size))
  const chunkattn::TppSizes sizes = chunkattn::check_tpp_args(args);
  const int64_t num_seqs = sizes.num_seqs, num_heads = sizes.num_heads, head_size = sizes.head_size;
  const int64_t block_size = sizes.block_size, num_kv_heads = sizes.num_kv_heads;
  const int64_t num_nodes = sizes.num_nodes;
  const at::Tensor &query = args.query, &out = args.out;
  const KvDtype kv_dtype = kv_dtype_of(args.key_cache);
  chunkattn::check_tpp_plan(sizes.num_blocks, block_size, args.plan);
  const chunkattn::PlanArrays plan = chunkattn::plan_arrays(args.plan);
  if (num_seqs == 0) return;

  // ---- kernel, query rows in the kernel's dtype, per-thread scratch
  const Kernel kernel = choose_kernel(args.key_cache.scalar_type(), query.scalar_type(), block_size, head_size,
                                      sizes.kv_amx_packed);
  const at::Tensor q = kernel.q_bf16 ? query.contiguous() : query.to(at::kFloat).contiguous();
  const int64_t q_row_bytes = head_size * (kernel.q_bf16 ? 2 : 4);
  const char* q_base = static_cast<const char*>(q.data_ptr());
  const int64_t group = num_heads / num_kv_heads;

  // Chunk-first work items: (node, kv head, sharer range). Few items (one long prefix, few kv
  // heads) are split by sharers so every thread works; each part re-reads the node's KV, from L2/L3.
  struct NodeItem { int64_t node, kv_head, begin, end, cost; };
  const int num_threads = at::get_num_threads();
  const int64_t min_items = 4 * num_threads;
  const int64_t base_items = num_nodes * num_kv_heads;
  const int64_t min_sharers = std::max<int64_t>(1, (16 + group - 1) / group);  // >= 16 rows a part
  std::vector<NodeItem> items;
  int64_t max_rows = group;
  for (int64_t n = 0; n < num_nodes; ++n) {
    const int64_t first = plan.node_seq_indptr[n], last = plan.node_seq_indptr[n + 1];  // its sharers
    const int64_t parts = base_items >= min_items ? 1 : (min_items + base_items - 1) / base_items;
    const int64_t step = std::max(min_sharers, (last - first + parts - 1) / parts);
    const int64_t tokens = int64_t(plan.node_block_indptr[n + 1] - plan.node_block_indptr[n]) * block_size;
    for (int64_t b = first; b < last; b += step) {
      const int64_t e = std::min<int64_t>(b + step, last);
      max_rows = std::max(max_rows, (e - b) * group);
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({n, h, b, e, tokens * (e - b)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const NodeItem& x, const NodeItem& y) { return x.cost > y.cost; });

  // Per thread: query rows [max_rows][head_size], then the sequence-first state o [group][head_size], m, l,
  // then each sequence's window edge [max_rows / group].
  const int64_t q_scratch = (max_rows * q_row_bytes + 63) / 64 * 64;
  const int64_t state_words = group * head_size + 2 * group;
  const int64_t thread_bytes = q_scratch + (state_words + max_rows / group + 1) * 4 + 64;
  // A row's first visible key (its window's edge), in positions of its sequence.
  const int64_t window = args.sliding_window;
  auto window_start = [&](int64_t row) -> int64_t {
    return window > 0 ? std::max<int64_t>(0, plan.seq_lens[row] - window) : 0;
  };
  std::vector<char> scratch(static_cast<size_t>(thread_bytes * num_threads) + 64);
  char* scratch_base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) / 64 * 64);

  AttendArgs proto{};
  proto.k = view_of(args.key_cache);
  proto.v = view_of(args.value_cache);
  proto.dtype = kv_dtype;
  proto.block_size = static_cast<int>(block_size);
  const bool fp8 = kv_dtype == KvDtype::kFp8E4m3 || kv_dtype == KvDtype::kFp8E5m2;
  // fp8: q . (k_scale * k) = (k_scale * q) . k, and sum p * (v_scale * v) = v_scale * sum p * v;
  // the kernels read e4m3 as its value * 2^-8 (tpp_attend.h).
  const double read_scale = kv_dtype == KvDtype::kFp8E4m3 ? 256.0 : 1.0;
  proto.scale = static_cast<float>(fp8 ? args.scale * args.k_scale * read_scale : args.scale);
  const float v_scale = fp8 ? static_cast<float>(args.v_scale * read_scale) : 1.f;
  proto.soft_cap = static_cast<float>(args.soft_cap);
  proto.rows_per_seq = static_cast<int>(group);
  float* po = args.partial_o.data_ptr<float>();
  float* pm = args.partial_m.data_ptr<float>();
  float* pl = args.partial_l.data_ptr<float>();

  // ---- phase 1, chunk-first: all rows of a node's sharers against its KV, read once
  auto chunk_first = [&](int64_t w, int tid) {
    const NodeItem& it = items[w];
    char* qrows = scratch_base + tid * thread_bytes;
    for (int64_t j = it.begin; j < it.end; ++j)
      for (int64_t g = 0; g < group; ++g)
        std::memcpy(qrows + ((j - it.begin) * group + g) * q_row_bytes,
                    q_base + (plan.node_seq_ids[j] * num_heads + it.kv_head * group + g) * q_row_bytes,
                    q_row_bytes);
    AttendArgs a = proto;
    a.kv_head = static_cast<int>(it.kv_head);
    a.block_ids = plan.node_block_ids + plan.node_block_indptr[it.node];
    a.num_tokens =
        static_cast<int>((plan.node_block_indptr[it.node + 1] - plan.node_block_indptr[it.node]) * block_size);
    a.q = qrows;
    a.num_rows = static_cast<int>((it.end - it.begin) * group);
    a.o = po + (it.begin * num_heads + it.kv_head * group) * head_size;
    a.m = pm + it.begin * num_heads + it.kv_head * group;
    a.l = pl + it.begin * num_heads + it.kv_head * group;
    a.o_seq_stride = num_heads * head_size;
    a.ml_seq_stride = num_heads;
    if (window > 0) {  // each sharer's edge, in the node's own positions
      int32_t* edge = reinterpret_cast<int32_t*>(qrows + q_scratch) + state_words;
      const int64_t node_start = int64_t(plan.node_first_block[it.node]) * block_size;
      for (int64_t j = it.begin; j < it.end; ++j)
        edge[j - it.begin] = static_cast<int32_t>(window_start(plan.node_seq_ids[j]) - node_start);
      a.first_key = edge;
    }
    kernel.fn(a);
  };

  // ---- phase 2, sequence-first: each row's private tail, merged with its partials, normalised
  char* out_base = static_cast<char*>(out.data_ptr());
  const int64_t out_esz = out.element_size();
  const std::optional<at::Tensor>& lse = args.lse;
  float* lse_base = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  const float* sinks = args.sinks.has_value() ? args.sinks->data_ptr<float>() : nullptr;
  auto sequence_first = [&](int64_t w, int tid) {
    const int64_t i = w / num_kv_heads, h = w % num_kv_heads;
    char* qrows = scratch_base + tid * thread_bytes;
    float* so = reinterpret_cast<float*>(qrows + q_scratch);
    float* sm = so + group * head_size;
    float* sl = sm + group;
    std::memcpy(qrows, q_base + (i * num_heads + h * group) * q_row_bytes, group * q_row_bytes);
    AttendArgs a = proto;
    a.kv_head = static_cast<int>(h);
    const int32_t shared_blocks = plan.seq_num_shared_blocks[i];
    a.block_ids = plan.block_table + i * plan.bt_stride + shared_blocks;
    a.num_tokens = static_cast<int>(plan.seq_lens[i] - int64_t(shared_blocks) * block_size);
    a.q = qrows;
    a.num_rows = static_cast<int>(group);
    a.o = so;
    a.m = sm;
    a.l = sl;
    a.o_seq_stride = group * head_size;
    a.ml_seq_stride = group;
    int32_t edge = 0;
    if (window > 0) {
      edge = static_cast<int32_t>(window_start(i) - int64_t(shared_blocks) * block_size);
      a.first_key = &edge;
    }
    kernel.fn(a);
    for (int64_t k = plan.seq_partial_indptr[i]; k < plan.seq_partial_indptr[i + 1]; ++k) {
      const int64_t row = int64_t(plan.seq_partial_ids[k]) * num_heads + h * group;
      for (int64_t g = 0; g < group; ++g)
        softmax_state_merge(so + g * head_size, sm + g, sl + g, po + (row + g) * head_size, pm[row + g],
                            pl[row + g], static_cast<int>(head_size));
    }
    for (int64_t g = 0; g < group; ++g) {
      const int64_t hh = h * group + g;
      if (sinks) softmax_state_add_sink(so + g * head_size, sm + g, sl + g, sinks[hh], static_cast<int>(head_size));
      void* dst = out_base + (i * out.stride(0) + hh * out.stride(1)) * out_esz;
      const float inv_l = softmax_state_inv_l(sl[g]) * v_scale;
      switch (out.scalar_type()) {
        case at::kFloat: store_out_row<float>(dst, so + g * head_size, inv_l, head_size); break;
        case at::kHalf: store_out_row<at::Half>(dst, so + g * head_size, inv_l, head_size); break;
        default: store_out_row<at::BFloat16>(dst, so + g * head_size, inv_l, head_size); break;
      }
      if (lse_base) lse_base[i * lse->stride(0) + hh * lse->stride(1)] = softmax_state_lse(sm[g], sl[g]);
    }
  };
  parallel_two_phases(static_cast<int64_t>(items.size()), num_seqs * num_kv_heads, num_threads,
                      chunk_first, sequence_first);
}

}  // namespace
}  // namespace chunkattn_cpu

TORCH_LIBRARY_IMPL(chunkattn, CPU, m) {
  m.impl("tpp_decode", &chunkattn::tpp_decode_entry<&chunkattn_cpu::tpp_decode_cpu>);
}
