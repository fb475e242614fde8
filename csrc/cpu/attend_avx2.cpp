// The fp32-compute attend kernel for AVX2 + FMA + F16C (Haswell and later, Zen).
// Any KV dtype, fp32 query rows.
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>

#include "tpp_attend.h"

#if defined(__x86_64__)
#define CHUNKATTN_ISA_AVX2
#pragma GCC target("avx2,fma,f16c")
namespace chunkattn_cpu {
namespace {
#include "vec_isa.h"
#include "attend_impl.h"
}  // namespace

AttendFn attend_avx2(int head_size) { return attend_f32_for_head_size<IsaAvx2>(head_size); }

}  // namespace chunkattn_cpu
#else
namespace chunkattn_cpu {
AttendFn attend_avx2(int) { return nullptr; }
}  // namespace chunkattn_cpu
#endif
