// Online-softmax state (o, m, l) of one query row, natural-log convention:
//   o = sum_t exp(s_t - m) v_t (unnormalised), m = max_t s_t, l = sum_t exp(s_t - m), lse = m + ln l.
// The empty state is (0, -inf, 0); merging two empty states stays empty, never NaN.
// Functions are static inline: this header is included by translation units compiled for
// different ISAs, and each must keep its own copy.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define SOFTMAX_STATE_FN static inline __host__ __device__
#else
#define SOFTMAX_STATE_FN static inline
#endif

// (o_a, m_a, l_a) <- merge((o_a, m_a, l_a), (o_b, m_b, l_b)); o has n elements.
SOFTMAX_STATE_FN void softmax_state_merge(float* o_a, float* m_a, float* l_a, const float* o_b,
                                          float m_b, float l_b, int n) {
  const float m = *m_a > m_b ? *m_a : m_b;
  if (m == -INFINITY) return;  // both empty: exp(-inf - -inf) would be NaN
  const float wa = expf(*m_a - m), wb = expf(m_b - m);
  for (int i = 0; i < n; ++i) o_a[i] = o_a[i] * wa + o_b[i] * wb;
  *l_a = *l_a * wa + l_b * wb;
  *m_a = m;
}

// An attention sink: one more logit `sink` in the denominator, for a key whose value is zero
// (gpt-oss). Merged into the final state before it is normalised; the lse then includes it.
SOFTMAX_STATE_FN void softmax_state_add_sink(float* o, float* m, float* l, float sink, int n) {
  const float m_new = *m > sink ? *m : sink;
  const float w = expf(*m - m_new);  // an empty state (m = -inf): w = 0, only the sink remains
  for (int i = 0; i < n; ++i) o[i] *= w;
  *l = *l * w + expf(sink - m_new);
  *m = m_new;
}

// Normalised output scale 1 / l (an empty state gives o = 0, not NaN) and lse = m + ln l
// (-inf when empty).
SOFTMAX_STATE_FN float softmax_state_inv_l(float l) { return 1.f / (l > 1e-30f ? l : 1e-30f); }
SOFTMAX_STATE_FN float softmax_state_lse(float m, float l) { return m + logf(l); }
