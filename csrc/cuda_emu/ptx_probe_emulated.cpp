// torch.ops.chunkattn_simt.ptx_probe: csrc/ptx_probe/ptx_probe.cuh's kernel on CPU tensors through
// the SIMT emulation (seed: its thread order and warp drift). Test-only.
#define CHUNKATTN_SIMT_EMULATION
#include <torch/library.h>

#include "../ptx_probe/ptx_probe.cuh"

namespace chunkattn {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> ptx_probe_emulated(const at::Tensor& a, const at::Tensor& bt,
                                                                  int64_t seed) {
  const PtxProbeCall c = ptx_probe_call(a, bt);
  TORCH_CHECK(a.device().is_cpu(), "chunkattn_simt.ptx_probe: the tensors must be on the CPU");
  simt::LaunchOptions o;
  o.seed = unsigned(seed);
  simt::launch(1, 1, 32, kProbeSmemBytes, [&c] {
    if (c.half)
      ptx_probe_kernel<__half>(c.args);
    else
      ptx_probe_kernel<__nv_bfloat16>(c.args);
  }, {}, o);
  return c.outputs();
}

}  // namespace
}  // namespace chunkattn

TORCH_LIBRARY_FRAGMENT(chunkattn_simt, m) { m.def("ptx_probe(Tensor a, Tensor bt, int seed) -> (Tensor, Tensor, Tensor)"); }
TORCH_LIBRARY_IMPL(chunkattn_simt, CPU, m) { m.impl("ptx_probe", &chunkattn::ptx_probe_emulated); }
