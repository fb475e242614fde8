// The shared body of the fp32 attend kernels' translation units (attend_avx512.cpp,
// attend_avx2.cpp, attend_scalar.cpp): attend_impl.h's kernel over the ISA struct the including
// file chose (CHUNKATTN_ISA_<name>), and its entry point of tpp_attend.h. The including file
// includes every system header first, then sets its `#pragma GCC target` and the ISA macro: what
// follows is compiled for that target, in an anonymous namespace (see vec_isa.h).
#include "tpp_attend.h"

namespace chunkattn_cpu {
namespace {
#include "vec_isa.h"
#include "attend_impl.h"
}  // namespace

#if defined(CHUNKATTN_ISA_AVX512)
AttendFn attend_avx512(int head_size) { return attend_f32_for_head_size<IsaAvx512>(head_size); }
#elif defined(CHUNKATTN_ISA_AVX2)
AttendFn attend_avx2(int head_size) { return attend_f32_for_head_size<IsaAvx2>(head_size); }
#elif defined(CHUNKATTN_ISA_SCALAR)
AttendFn attend_scalar(int head_size) { return attend_f32_for_head_size<IsaScalar>(head_size); }
#else
#error "attend_f32_unit.h: define CHUNKATTN_ISA_AVX512, CHUNKATTN_ISA_AVX2 or CHUNKATTN_ISA_SCALAR first"
#endif

}  // namespace chunkattn_cpu
