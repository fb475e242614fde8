// The fp32-compute attend kernel for plain C++ (any CPU; correctness fallback, not tuned).
// Any KV dtype, fp32 query rows.
#include <cmath>
#include <cstdint>

#include "tpp_attend.h"

#define CHUNKATTN_ISA_SCALAR
#include "attend_f32_unit.h"  // attend_scalar
