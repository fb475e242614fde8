// Torch glue of the CUDA TPP decode: device checks, dtype / head-size dispatch and the launch of
// chunkattn::tpp_decode's CUDA kernel (schema: csrc/torch_bindings.cpp). The kernel's own
// argument limits and the split-KV choice are in tpp_host.h, shared with the CPU emulation.
//
// CUDA graphs. The op never synchronises with the host and allocates nothing: every grid size
// comes from host ints (tensor shapes, the device's resident CTAs, env overrides). Two modes, same code:
//   exact:    plan tensors sized by the plan (num_nodes, num_partials from their shapes);
//   capacity: plan tensors padded to fixed capacities for a captured batch size: extra nodes
//             are empty (node_*_indptr repeat their last value), extra rows have seq_len 0 and
//             an empty seq_partial range. Grids are sized by the capacities and the CTAs of empty
//             nodes / rows exit or write empty states (m = -inf), so one capture replays any plan
//             that fits. The host sees only the capacities, so the chunk-first KV splits are
//             chosen by the CTAs from the real plan (tpp_params.cuh, chunk_splits_of); picked
//             from the padded shapes they would be one split, up to 4x slower than eager (H200).
//             Padded rows come out as 0 with lse = -inf. Every per-row tensor has the
//             padded row count (the shared contract); the index checks ran before padding.
// Split-KV scratch. partial_o/m/l rows past num_partials are spare slots: with S_c KV splits per
// chunk partial and S_s per private tail the op needs S_c*P + num_seqs*(S_s - 1) rows, and lowers
// S_s, then S_c, to what the workspace holds; a workspace of exactly num_partials rows means no
// split at all (still correct). The schema stays as it is.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>

#include "tpp_host.h"

namespace chunkattn {
namespace {

// A device attribute, read once per device (fallback when the runtime cannot tell).
template <cudaDeviceAttr kAttr>
int device_attribute(int device, int fallback) {
  static int cache[64] = {};
  if (device < 0 || device >= 64) device = 0;
  if (cache[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, kAttr, device) != cudaSuccess || n <= 0) n = fallback;
    cache[device] = n;
  }
  return cache[device];
}

int sm_count(int device) { return device_attribute<cudaDevAttrMultiProcessorCount>(device, 100); }

// Partial-kernel CTAs the device runs at once (SMs x CTAs per SM), read once per device, dtype,
// KV kind (16-bit or fp8), head size and stage size, with the device current. The kernel's
// __launch_bounds__ minimum (2, or 3 in the compact stage) if the occupancy query fails, or while
// `stream` is being captured before any eager call asked (no query inside a capture).
int resident_ctas(int device, bool half, bool fp8_kv, int head_size, cudaStream_t stream) {
  static int cache[64][2][2][4][2] = {};
  if (device < 0 || device >= 64) device = 0;
  const int d = head_size == 64 ? 0 : head_size == 96 ? 1 : head_size == 128 ? 2 : 3;
  const int tokens = partial_stage_tokens(head_size);
  const int fallback = partial_min_ctas(head_size, tokens);
  int& n = cache[device][half ? 1 : 0][fp8_kv ? 1 : 0][d][tokens == default_stage_tokens(head_size) ? 0 : 1];
  if (n == 0) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) (void)cudaGetLastError();
    if (capture != cudaStreamCaptureStatusNone) return fallback * sm_count(device);
    const int per_sm = with_tpp_types(half, fp8_kv, head_size, [tokens](auto t, auto fp8, auto d) {
      return tpp_partial_ctas_per_sm<typename decltype(t)::type, decltype(fp8)::value, decltype(d)::value>(tokens);
    });
    n = sm_count(device) * (per_sm > 0 ? per_sm : fallback);
  }
  return n;
}

// The final launch overlaps the partial one (programmatic dependent launch, sm_90+) unless
// CHUNKATTN_OVERLAP_FINAL=0 (benchmarks time both; a captured graph keeps what it was captured with).
bool overlap_final(int device) {
  const char* v = std::getenv("CHUNKATTN_OVERLAP_FINAL");
  return device_attribute<cudaDevAttrComputeCapabilityMajor>(device, 0) >= 9 && !(v && v[0] == '0');
}

// What the device can give a block (head 256 needs more than sm_86/89/120's 99 KB). 0: unknown.
int smem_optin_bytes(int device) {
  return device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device, 0);
}

void check_device(const at::Tensor& t, const char* name, const at::Tensor& query) {
  TORCH_CHECK(t.device() == query.device(), "tpp_decode: ", name, " must be on ", query.device(), ", got ",
              t.device());
}

void tpp_decode_cuda(const TppArgs& a) {
  // The contract every device shares (csrc/tpp_checks.h): shapes, dtypes, strides. The plan's
  // index ranges are checked on the host where the plan is built (chunkattn::tpp_check_plan, run
  // by vllm_chunkattn/plan once per step): reading them here would sync every layer.
  const TppSizes s = check_tpp_args(a);
  check_tensor_core_args(s, a);
  const at::Tensor& query = a.query;
  a.for_each_tensor([&query](const at::Tensor& t, const char* name) { check_device(t, name, query); });
  {
    const int need = tpp_partial_smem_bytes(s.head_size), have = smem_optin_bytes(query.get_device());
    TORCH_CHECK(have == 0 || need <= have, "tpp_decode: head_size ", s.head_size, " needs ", need,
                " bytes of shared memory per block; this GPU allows ", have,
                ". Serve this model without --attention-backend CUSTOM on this GPU.");
  }
  const c10::cuda::CUDAGuard guard(query.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(query.get_device()).stream();
  const bool half = query.scalar_type() == at::kHalf, fp8_kv = is_fp8_kv(a.key_cache);
  const TppParams p =
      make_tpp_params(s, a, resident_ctas(query.get_device(), half, fp8_kv, int(s.head_size), stream));
  if (p.num_seqs == 0) return;

  const cudaError_t err = with_tpp_types(half, fp8_kv, int(s.head_size), [&](auto t, auto fp8, auto d) {
    return launch_tpp_decode<typename decltype(t)::type, decltype(fp8)::value, decltype(d)::value>(
        p, stream, overlap_final(query.get_device()));
  });
  TORCH_CHECK(err == cudaSuccess, "chunkattn::tpp_decode CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace chunkattn

TORCH_LIBRARY_IMPL(chunkattn, CUDA, m) {
  m.impl("tpp_decode", &chunkattn::tpp_decode_entry<&chunkattn::tpp_decode_cuda>);
}
