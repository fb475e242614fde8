// torch.ops.chunkattn_simt.ptx_probe: csrc/ptx_probe/ptx_probe.cuh's kernel on CPU tensors through
// the SIMT emulation (seed: its thread order and warp drift). Test-only.
#define CHUNKATTN_SIMT_EMULATION
#include <torch/library.h>

#include "../ptx_probe/ptx_probe.cuh"

namespace chunkattn {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> ptx_probe_emulated(const at::Tensor& a, const at::Tensor& bt,
                                                                  int64_t seed) {
  auto [ld, ldt, mma] = ptx_probe_outputs(a, bt);
  TORCH_CHECK(a.device().is_cpu(), "chunkattn_simt.ptx_probe: the tensors must be on the CPU");
  const auto* pa = static_cast<const uint16_t*>(a.data_ptr());
  const auto* pb = static_cast<const uint16_t*>(bt.data_ptr());
  auto* pld = static_cast<uint32_t*>(ld.data_ptr());
  auto* pldt = static_cast<uint32_t*>(ldt.data_ptr());
  auto* pmma = mma.data_ptr<float>();
  simt::LaunchOptions o;
  o.seed = unsigned(seed);
  const bool half = a.scalar_type() == at::kHalf;
  simt::launch(1, 1, 32, kProbeSmemBytes, [&] {
    if (half)
      ptx_probe_kernel<__half>(pa, pb, pld, pldt, pmma);
    else
      ptx_probe_kernel<__nv_bfloat16>(pa, pb, pld, pldt, pmma);
  }, {}, o);
  return {ld, ldt, mma};
}

}  // namespace
}  // namespace chunkattn

TORCH_LIBRARY_FRAGMENT(chunkattn_simt, m) { m.def("ptx_probe(Tensor a, Tensor bt, int seed) -> (Tensor, Tensor, Tensor)"); }
TORCH_LIBRARY_IMPL(chunkattn_simt, CPU, m) { m.impl("ptx_probe", &chunkattn::ptx_probe_emulated); }
