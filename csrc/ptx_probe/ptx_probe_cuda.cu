// torch.ops.chunkattn_probe.ptx_probe on a GPU (ptx_probe.cuh says what it is for). Test-only.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ptx_probe.cuh"

namespace chunkattn {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> ptx_probe_cuda(const at::Tensor& a, const at::Tensor& bt) {
  const PtxProbeCall c = ptx_probe_call(a, bt);
  const c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.get_device()).stream();
  if (c.half)
    ptx_probe_kernel<__half><<<1, 32, kProbeSmemBytes, stream>>>(c.args);
  else
    ptx_probe_kernel<__nv_bfloat16><<<1, 32, kProbeSmemBytes, stream>>>(c.args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return c.outputs();
}

}  // namespace
}  // namespace chunkattn

TORCH_LIBRARY(chunkattn_probe, m) { m.def("ptx_probe(Tensor a, Tensor bt) -> (Tensor, Tensor, Tensor)"); }
TORCH_LIBRARY_IMPL(chunkattn_probe, CUDA, m) { m.impl("ptx_probe", &chunkattn::ptx_probe_cuda); }
