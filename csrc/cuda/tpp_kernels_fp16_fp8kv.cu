// Explicit instantiations of the fp16 TPP kernels over an fp8 (e4m3 / e5m2) KV cache (one file per
// query dtype and KV kind so nvcc jobs run in parallel).
#define CHUNKATTN_INSTANTIATE
#include "tpp_kernels.cuh"

namespace chunkattn {
CHUNKATTN_TPP_INSTANCES(, __half, true)
}  // namespace chunkattn
