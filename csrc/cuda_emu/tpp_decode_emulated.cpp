// torch.ops.chunkattn_simt.tpp_decode: the CUDA op (csrc/cuda/tpp_decode.cu) run on CPU tensors
// through the SIMT emulation, for tests on machines without a GPU. Same argument checks, same
// TppParams and split choice (tpp_host.h), same launch shapes and the same kernel source
// (tpp_kernels.cuh); only the GPU is stood in for (simt_emu.h). Extra arguments: the resident
// CTAs the split choice sizes its waves for (default: an H100 at head 128, 132 SMs x 2), the
// emulation's seed and its cp.async landing mode. tpp_work: the decomposition alone (make_tpp_work).
// Test-only: built by vllm_chunkattn.ops.jit_build.load_simt_emulation, never by setup.py.
#define CHUNKATTN_SIMT_EMULATION
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "../cuda/tpp_host.h"
#include "../tpp_schema.h"

namespace chunkattn {
namespace {

simt::GlobalRange bytes_of(const at::Tensor& t) {
  int64_t last = 0;  // offset of the last element reachable through the strides
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {t.data_ptr(), t.numel() == 0 ? 0 : (last + 1) * int64_t(t.element_size())};
}

// The last emulated call's launches (tests: which final kernel ran, in how much smem) and its
// KV address path (TppParams::kv_offsets_i32).
TppLaunchShape g_last_launch{};
int g_last_kv_offsets_i32 = -1;

// The final launch as the GPU may run it beside the partial one (overlap_final): each final CTA
// finds the workspace's slots NaN until it waits for the partial grid, then their real values.
// `workspace`: the byte ranges of partial_o / m / l.
template <typename T, bool FP8, int D>
void emulate(const TppParams& p, const std::vector<simt::GlobalRange>& globals, const simt::LaunchOptions& o,
             const std::vector<simt::GlobalRange>& workspace) {
  const TppLaunchShape shape = tpp_launch_shape<D>(p);
  g_last_launch = shape;
  if (shape.partial_grid_x > 0)
    with_partial_stage<D>(p, [&](auto tokens) {
      simt::launch(shape.partial_grid_x, p.num_kv_heads, kThreads, shape.partial_smem,
                   [&p] { tpp_partial_kernel<T, D, decltype(tokens)::value, FP8>(p); }, globals, o);
    });
  if (shape.final_grid_x > 0) {
    std::vector<std::vector<char>> written;
    for (const simt::GlobalRange& r : workspace)
      written.emplace_back(static_cast<const char*>(r.begin), static_cast<const char*>(r.begin) + r.bytes);
    simt::LaunchOptions dependent = o;
    dependent.before_cta = [&] {
      for (const simt::GlobalRange& r : workspace) std::memset(const_cast<void*>(r.begin), 0xff, r.bytes);  // NaN
    };
    dependent.primary_grid_done = [&] {
      for (size_t i = 0; i < workspace.size(); ++i)
        std::memcpy(const_cast<void*>(workspace[i].begin), written[i].data(), workspace[i].bytes);
    };
    with_final_stage<D>(p, [&](auto tokens) {
      simt::launch(shape.final_grid_x, p.num_kv_heads, kThreads, shape.final_smem,
                   [&p] { tpp_final_kernel<T, D, decltype(tokens)::value, FP8>(p); }, globals, dependent);
    });
    dependent.primary_grid_done();  // the workspace as the partial launch left it
  }
}

void tpp_decode_emulated(const TppArgs& a, int64_t resident_ctas, int64_t seed, bool cp_async_lands_at_issue) {
  const TppSizes s = check_tpp_args(a);
  check_tensor_core_args(s, a);
  const TppParams p = make_tpp_params(s, a, resident_ctas);
  if (p.num_seqs == 0) return;
  g_last_kv_offsets_i32 = p.kv_offsets_i32;
  std::vector<simt::GlobalRange> globals;
  a.for_each_tensor([&globals](const at::Tensor& t, const char*) {
    TORCH_CHECK(t.device().is_cpu(), "chunkattn_simt.tpp_decode: every tensor must be on the CPU");
    globals.push_back(bytes_of(t));
  });
  simt::LaunchOptions o;
  o.seed = unsigned(seed);
  o.cp_async_lands_at_issue = cp_async_lands_at_issue;
  const bool half = a.query.scalar_type() == at::kHalf;
  with_tpp_types(half, is_fp8_kv(a.key_cache), int(s.head_size), [&](auto t, auto fp8, auto d) {
    emulate<typename decltype(t)::type, decltype(fp8)::value, decltype(d)::value>(
        p, globals, o, {bytes_of(a.partial_o), bytes_of(a.partial_m), bytes_of(a.partial_l)});
  });
}

// [partial grid x, final grid x, partial smem, final smem, kv_offsets_i32] of the last
// tpp_decode call.
std::vector<int64_t> last_launch() {
  const TppLaunchShape& l = g_last_launch;
  return {l.partial_grid_x, l.final_grid_x, l.partial_smem, l.final_smem, g_last_kv_offsets_i32};
}

// The kernel's shared memory per head size, for the test of vllm_chunkattn/ops/cuda_fit.py's copy.
int64_t partial_smem_bytes(int64_t head_size) { return tpp_partial_smem_bytes(int(head_size)); }

// make_tpp_work for sizes alone: [chunk_heads, chunk_head_tiles, chunk_seqs, num_windows,
// seq_heads, seq_head_tiles, chunk_splits, seq_splits, chunk_ctas, device_splits].
std::vector<int64_t> tpp_work(int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                              int64_t num_nodes, int64_t num_partials, int64_t node_blocks, int64_t table_width,
                              int64_t slots, int64_t resident_ctas, int64_t sliding_window) {
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && block_size > 0 && slots >= num_partials,
              "chunkattn_simt.tpp_work: sizes no call would pass");
  TppSizes s{};
  s.num_seqs = num_seqs;
  s.num_heads = num_heads;
  s.num_kv_heads = num_kv_heads;
  s.block_size = block_size;
  s.num_nodes = num_nodes;
  s.num_partials = num_partials;
  const TppWork w = make_tpp_work(s, node_blocks, table_width, slots, resident_ctas, sliding_window);
  return {w.chunk_heads, w.chunk_head_tiles, w.chunk_seqs, w.num_windows,
          w.seq_heads, w.seq_head_tiles, w.chunk_splits, w.seq_splits, w.chunk_ctas,
          w.device_splits};
}

}  // namespace
}  // namespace chunkattn

TORCH_LIBRARY(chunkattn_simt, m) {
  m.def("tpp_decode(" CHUNKATTN_TPP_DECODE_ARGS
        ", int resident_ctas=264, int seed=0, bool cp_async_lands_at_issue=False) -> ()");
  // No tensors: catch-all kernels.
  m.def("partial_smem_bytes(int head_size) -> int", &chunkattn::partial_smem_bytes);
  m.def("last_launch() -> int[]", &chunkattn::last_launch);
  m.def("tpp_work(int num_seqs, int num_heads, int num_kv_heads, int block_size, int num_nodes, int num_partials, "
        "int node_blocks, int table_width, int slots, int resident_ctas, int sliding_window=0) -> int[]",
        &chunkattn::tpp_work);
}
TORCH_LIBRARY_IMPL(chunkattn_simt, CPU, m) {
  m.impl("tpp_decode", &chunkattn::tpp_decode_entry<&chunkattn::tpp_decode_emulated, int64_t, int64_t, bool>);
}
