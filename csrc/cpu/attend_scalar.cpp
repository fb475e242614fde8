// The fp32-compute attend kernel for plain C++ (any CPU; correctness fallback, not tuned).
// Any KV dtype, fp32 query rows.
#include <cmath>
#include <cstdint>

#include "tpp_attend.h"

#define CHUNKATTN_ISA_SCALAR

namespace chunkattn_cpu {
namespace {
#include "vec_isa.h"
#include "attend_impl.h"
}  // namespace

AttendFn attend_scalar(int head_size) { return attend_f32_for_head_size<IsaScalar>(head_size); }

}  // namespace chunkattn_cpu
