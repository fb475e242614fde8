// Explicit instantiations of the fp16 TPP kernels (one file per dtype so nvcc jobs run in parallel).
#define CHUNKATTN_INSTANTIATE
#include "tpp_kernels.cuh"

namespace chunkattn {
CHUNKATTN_TPP_INSTANCES(, __half)
}  // namespace chunkattn
