// One row's elementwise maths of the decoder layer, shared by the ops that run it over a step's rows
// (cpu_elementwise.cpp) and the decode step's single parallel region (cpu_decode_region.cpp): both call these,
// so both make the same roundings, bit for bit. float32, AVX2; transformers' LlamaRMSNorm, SiLU and
// apply_rotary_pos_emb, with the same operation order.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "vec_math.h"

namespace tpserve {

// y = w * (x / sqrt(mean(x^2) + eps)) for one row of n floats (y may be x).
inline void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* y) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float sum = hsum(acc);
  for (; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  for (i = 0; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv)));
  }
  for (; i < n; ++i) y[i] = w[i] * (x[i] * inv);
}

// s = a + b for one row of n floats (the residual stream's add).
inline void add_row(const float* a, const float* b, int64_t n, float* s) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  for (; i < n; ++i) s[i] = a[i] + b[i];
}

// o = silu(g) * u for one row of n floats; silu(g) = g / (1 + exp(-g)).
inline void silu_mul_row(const float* g, const float* u, int64_t n, float* o) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

// One head x (d floats, d even) rotated in place by (c, s) (d each), the "rotate half" layout:
// out[i] = x[i] c[i] - x[i + d/2] s[i] for i < d/2 and x[i] c[i] + x[i - d/2] s[i] above.
inline void rotate_half_head(float* x, const float* c, const float* s, int64_t d) {
  const int64_t half = d / 2;
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
    // Separate multiplies and adds (no FMA): the same roundings as x * cos + rotate_half(x) * sin.
    const __m256 lo = _mm256_add_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)),
                                    _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), x2), _mm256_loadu_ps(s + i)));
    const __m256 hi = _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + i)),
                                    _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + i)));
    _mm256_storeu_ps(x + i, lo);
    _mm256_storeu_ps(x + half + i, hi);
  }
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    x[i] = x1 * c[i] + (-x2) * s[i];
    x[half + i] = x2 * c[half + i] + x1 * s[half + i];
  }
}

}  // namespace tpserve
