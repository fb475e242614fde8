// The fp32-compute attend kernel for AVX2 + FMA + F16C (Haswell and later, Zen).
// Any KV dtype, fp32 query rows.
#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "tpp_attend.h"

#pragma GCC target("avx2,fma,f16c")
#define CHUNKATTN_ISA_AVX2
#include "attend_f32_unit.h"  // attend_avx2
#endif
