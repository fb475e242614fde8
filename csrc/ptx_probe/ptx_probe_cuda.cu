// torch.ops.chunkattn_probe.ptx_probe on a GPU (ptx_probe.cuh says what it is for). Test-only.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ptx_probe.cuh"

namespace chunkattn {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> ptx_probe_cuda(const at::Tensor& a, const at::Tensor& bt) {
  auto [ld, ldt, mma] = ptx_probe_outputs(a, bt);
  const c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.get_device()).stream();
  const auto* pa = static_cast<const uint16_t*>(a.data_ptr());
  const auto* pb = static_cast<const uint16_t*>(bt.data_ptr());
  auto* pld = static_cast<uint32_t*>(ld.data_ptr());
  auto* pldt = static_cast<uint32_t*>(ldt.data_ptr());
  auto* pmma = mma.data_ptr<float>();
  if (a.scalar_type() == at::kHalf)
    ptx_probe_kernel<__half><<<1, 32, kProbeSmemBytes, stream>>>(pa, pb, pld, pldt, pmma);
  else
    ptx_probe_kernel<__nv_bfloat16><<<1, 32, kProbeSmemBytes, stream>>>(pa, pb, pld, pldt, pmma);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {ld, ldt, mma};
}

}  // namespace
}  // namespace chunkattn

TORCH_LIBRARY(chunkattn_probe, m) { m.def("ptx_probe(Tensor a, Tensor bt) -> (Tensor, Tensor, Tensor)"); }
TORCH_LIBRARY_IMPL(chunkattn_probe, CUDA, m) { m.impl("ptx_probe", &chunkattn::ptx_probe_cuda); }
