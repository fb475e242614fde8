// Explicit instantiations of the fp16 TPP kernels (one file per dtype so nvcc jobs run in parallel).
#define CHUNKATTN_INSTANTIATE
#include "tpp_kernels.cuh"

namespace chunkattn {
template cudaError_t launch_tpp_decode<__half, 64>(const TppParams&, cudaStream_t, bool);
template int tpp_partial_ctas_per_sm<__half, 64>();
template cudaError_t launch_tpp_decode<__half, 128>(const TppParams&, cudaStream_t, bool);
template int tpp_partial_ctas_per_sm<__half, 128>();
template cudaError_t launch_tpp_decode<__half, 256>(const TppParams&, cudaStream_t, bool);
template int tpp_partial_ctas_per_sm<__half, 256>();
}  // namespace chunkattn
