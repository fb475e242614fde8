// Explicit instantiations of the bf16 TPP kernels (one file per dtype so nvcc jobs run in parallel).
#define CHUNKATTN_INSTANTIATE
#include "tpp_kernels.cuh"

namespace chunkattn {
CHUNKATTN_TPP_INSTANCES(, __nv_bfloat16)
}  // namespace chunkattn
