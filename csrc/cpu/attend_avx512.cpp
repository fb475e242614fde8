// The fp32-compute attend kernel for AVX-512F/BW/VL/DQ (Skylake-X and later, Zen 4).
// Any KV dtype, fp32 query rows.
#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "tpp_attend.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define CHUNKATTN_ISA_AVX512
#include "attend_f32_unit.h"  // attend_avx512
#endif
