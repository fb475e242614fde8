// fp32 SIMD vocabulary of the attend kernels, one struct per ISA. Include only after the including
// file's `#pragma GCC target(...)` and inside an anonymous namespace, so every function is compiled
// for that target and none leaks to another translation unit (no ODR clash between ISAs).
//
// Members: reg, W (lanes), load/store/set1/zero/add/sub/mul/div/fma/fnmadd/max, reduce_max/reduce_add,
// exp (exp(-inf) == 0 exactly: masked keys must add nothing), and the kernel's tile shapes
// kQkRows (query rows per score micro-kernel), kPvRows x kPvVecs (rows x registers of the P.V one).

// The members whose intrinsics are named alike on AVX-512 and AVX2 but for the prefix P (_mm512,
// _mm256). fma(a, b, c) = a * b + c and fnmadd(a, b, c) = c - a * b, each rounded once.
#define CHUNKATTN_SIMD_MEMBERS(P)                                           \
  static reg load(const float* p) { return P##_loadu_ps(p); }               \
  static void store(float* p, reg v) { P##_storeu_ps(p, v); }               \
  static reg set1(float x) { return P##_set1_ps(x); }                       \
  static reg zero() { return P##_setzero_ps(); }                            \
  static reg add(reg a, reg b) { return P##_add_ps(a, b); }                 \
  static reg sub(reg a, reg b) { return P##_sub_ps(a, b); }                 \
  static reg mul(reg a, reg b) { return P##_mul_ps(a, b); }                 \
  static reg div(reg a, reg b) { return P##_div_ps(a, b); }                 \
  static reg fma(reg a, reg b, reg c) { return P##_fmadd_ps(a, b, c); }     \
  static reg fnmadd(reg a, reg b, reg c) { return P##_fnmadd_ps(a, b, c); } \
  static reg max(reg a, reg b) { return P##_max_ps(a, b); }

// The SIMD exps' shared part: e^r for r = x - n ln2 (n = round(x / ln2), so |r| <= ln2 / 2), ln2
// taken in two parts so that r keeps fp32 precision, by the degree-6 Taylor polynomial in Horner
// form. The caller scales by 2^n.
template <class I>
inline typename I::reg exp_reduced(typename I::reg x, typename I::reg n) {
  using reg = typename I::reg;
  reg r = I::fnmadd(n, I::set1(0.693145752f), x);
  r = I::fnmadd(n, I::set1(1.42860677e-6f), r);
  reg p = I::set1(1.f / 720);
  p = I::fma(p, r, I::set1(1.f / 120));
  p = I::fma(p, r, I::set1(1.f / 24));
  p = I::fma(p, r, I::set1(1.f / 6));
  p = I::fma(p, r, I::set1(0.5f));
  p = I::fma(p, r, I::set1(1.f));
  return I::fma(p, r, I::set1(1.f));
}

#if defined(CHUNKATTN_ISA_AVX512)
struct IsaAvx512 {
  using reg = __m512;
  static constexpr int W = 16;
  static constexpr int kQkRows = 8;  // 8 rows x 2 vectors = 16 accumulators of 32
  static constexpr int kPvRows = 2;
  static constexpr int kPvVecs = 8;
  CHUNKATTN_SIMD_MEMBERS(_mm512)
  static float reduce_max(reg v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(reg v) { return _mm512_reduce_add_ps(v); }
  static reg exp(reg x) {
    // exp(x) = 2^n * e^r; scalef underflows cleanly to 0 for n <= -150.
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // also maps -inf (masked keys) to 0
    x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
    const reg n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(exp_reduced<IsaAvx512>(x, n), n);
  }
};
#endif

#if defined(CHUNKATTN_ISA_AVX2)
struct IsaAvx2 {
  using reg = __m256;
  static constexpr int W = 8;
  static constexpr int kQkRows = 2;  // 16 ymm registers: 2 rows x 4 vectors + 4 keys + 1
  static constexpr int kPvRows = 1;
  static constexpr int kPvVecs = 8;
  CHUNKATTN_SIMD_MEMBERS(_mm256)
  static float reduce_max(reg v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
  }
  static float reduce_add(reg v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
  }
  static reg exp(reg x) {
    // exp(x) = 2^n * e^r. Below -87.3 the result would be denormal: flush to 0 (this also covers -inf).
    const reg keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const reg n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(exp_reduced<IsaAvx2>(x, n), _mm256_castsi256_ps(e)), keep);
  }
};
#endif

#if defined(CHUNKATTN_ISA_SCALAR)
struct IsaScalar {
  using reg = float;
  static constexpr int W = 1;
  static constexpr int kQkRows = 1;
  static constexpr int kPvRows = 1;
  static constexpr int kPvVecs = 8;
  static reg load(const float* p) { return *p; }
  static void store(float* p, reg v) { *p = v; }
  static reg set1(float x) { return x; }
  static reg zero() { return 0.f; }
  static reg add(reg a, reg b) { return a + b; }
  static reg sub(reg a, reg b) { return a - b; }
  static reg mul(reg a, reg b) { return a * b; }
  static reg div(reg a, reg b) { return a / b; }
  static reg fma(reg a, reg b, reg c) { return a * b + c; }
  static reg fnmadd(reg a, reg b, reg c) { return c - a * b; }
  static reg max(reg a, reg b) { return a > b ? a : b; }
  static float reduce_max(reg v) { return v; }
  static float reduce_add(reg v) { return v; }
  static reg exp(reg x) { return expf(x); }
};
#endif

// cap * tanh(x / cap) with tanh(y) = 1 - 2 / (e^{2y} + 1): exp saturates (never inf or NaN), so
// large |y| gives exactly +-1. The absolute error near 0 is ~cap * 2^-24, far below a logit's.
template <class I>
inline typename I::reg soft_capped(typename I::reg x, float cap) {
  const typename I::reg e = I::exp(I::mul(x, I::set1(2.f / cap)));
  return I::mul(I::set1(cap), I::sub(I::set1(1.f), I::div(I::set1(2.f), I::add(e, I::set1(1.f)))));
}
