// Explicit instantiations of the bf16 TPP kernels (one file per dtype so nvcc jobs run in parallel).
#define CHUNKATTN_INSTANTIATE
#include "tpp_kernels.cuh"

namespace chunkattn {
template cudaError_t launch_tpp_decode<__nv_bfloat16, 64>(const TppParams&, cudaStream_t, bool);
template int tpp_partial_ctas_per_sm<__nv_bfloat16, 64>();
template cudaError_t launch_tpp_decode<__nv_bfloat16, 128>(const TppParams&, cudaStream_t, bool);
template int tpp_partial_ctas_per_sm<__nv_bfloat16, 128>();
template cudaError_t launch_tpp_decode<__nv_bfloat16, 256>(const TppParams&, cudaStream_t, bool);
template int tpp_partial_ctas_per_sm<__nv_bfloat16, 256>();
}  // namespace chunkattn
