// fp32 SIMD vocabulary of the attend kernels, one struct per ISA. Include only after the including
// file's `#pragma GCC target(...)` and inside an anonymous namespace, so every function is compiled
// for that target and none leaks to another translation unit (no ODR clash between ISAs).
//
// Members: reg, W (lanes), load/store/set1/zero/add/sub/mul/fma/max, reduce_max/reduce_add,
// exp (exp(-inf) == 0 exactly: masked keys must add nothing), and the kernel's tile shapes
// kQkRows (query rows per score micro-kernel), kPvRows x kPvVecs (rows x registers of the P.V one).

#if defined(CHUNKATTN_ISA_AVX512)
struct IsaAvx512 {
  using reg = __m512;
  static constexpr int W = 16;
  static constexpr int kQkRows = 8;  // 8 rows x 2 vectors = 16 accumulators of 32
  static constexpr int kPvRows = 2;
  static constexpr int kPvVecs = 8;
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg zero() { return _mm512_setzero_ps(); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static float reduce_max(reg v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(reg v) { return _mm512_reduce_add_ps(v); }
  static reg exp(reg x) {
    // exp(x) = 2^n * e^r, |r| <= ln2/2; scalef underflows cleanly to 0 for n <= -150.
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // also maps -inf (masked keys) to 0
    x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
    reg n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    reg r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    reg p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
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
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg zero() { return _mm256_setzero_ps(); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
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
    // Below -87.3 the result would be denormal: flush to 0 (this also covers -inf).
    reg keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    reg n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    reg r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    reg p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
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
  static reg fma(reg a, reg b, reg c) { return a * b + c; }
  static reg max(reg a, reg b) { return a > b ? a : b; }
  static float reduce_max(reg v) { return v; }
  static float reduce_add(reg v) { return v; }
  static reg exp(reg x) { return expf(x); }
};
#endif
