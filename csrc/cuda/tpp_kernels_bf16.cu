// Explicit instantiations of the bf16 TPP kernels over a bf16 KV cache (one file per query dtype
// and KV kind so nvcc jobs run in parallel).
#define CHUNKATTN_INSTANTIATE
#include "tpp_kernels.cuh"

namespace chunkattn {
CHUNKATTN_TPP_INSTANCES(, __nv_bfloat16, false)
}  // namespace chunkattn
