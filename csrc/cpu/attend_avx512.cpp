// The fp32-compute attend kernel for AVX-512F/BW/VL/DQ (Skylake-X and later, Zen 4).
// Any KV dtype, fp32 query rows.
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>

#include "tpp_attend.h"

#if defined(__x86_64__)
#define CHUNKATTN_ISA_AVX512
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace chunkattn_cpu {
namespace {
#include "vec_isa.h"
#include "attend_impl.h"
}  // namespace

AttendFn attend_avx512(int head_size) { return attend_f32_for_head_size<IsaAvx512>(head_size); }

}  // namespace chunkattn_cpu
#else
namespace chunkattn_cpu {
AttendFn attend_avx512(int) { return nullptr; }
}  // namespace chunkattn_cpu
#endif
