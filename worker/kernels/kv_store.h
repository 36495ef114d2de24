// One (token, KV head) row written into an 8-bit KV cache (worker/kv_quant.py): its codes and bfloat16 scale.
// Shared by the ops that write a step's rows (cpu_elementwise.cpp's rotary_and_cache) and the decode step's
// parallel region (cpu_decode_region.cpp), so both write the same bits.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "vec_math.h"

namespace tpserve {

// y = x - offset (offset null: none), the row's scale s = bf16(max(absmax(y), 2^-100) / qmax) into *scale_dst,
// and the codes of y / s (saturated at +-qmax; rounded to nearest even: int8, or c10's e4m3 conversion:
// c10::Float8_e4m3fn) into dst: the same float operations as torch's kv_quant.quantize. d <= 256.
template <typename T>
inline void store_row(T* dst, c10::BFloat16* scale_dst, const float* x, const float* offset, int64_t d) {
  constexpr float qmax = std::is_same_v<T, int8_t> ? 127.0f : 448.0f;
  alignas(32) float y[256];  // d <= 256 (checked)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {  // y = x - offset and max |y|, 8 at a time (exact either way)
    __m256 v = _mm256_loadu_ps(x + i);
    if (offset) v = _mm256_sub_ps(v, _mm256_loadu_ps(offset + i));
    _mm256_store_ps(y + i, v);
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
  }
  float absmax = hmax(vmax);
  for (; i < d; ++i) {
    y[i] = offset ? x[i] - offset[i] : x[i];
    absmax = std::max(absmax, std::fabs(y[i]));
  }
  const c10::BFloat16 s(std::max(absmax, 0x1p-100f) / qmax);
  *scale_dst = s;
  const float sf = static_cast<float>(s);
  const __m256 vs = _mm256_set1_ps(sf), hi = _mm256_set1_ps(qmax), lo = _mm256_set1_ps(-qmax);
  for (i = 0; i + 8 <= d; i += 8) {  // the codes: y / s saturated (the same division as torch's)
    const __m256 c = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_div_ps(_mm256_load_ps(y + i), vs)));
    if constexpr (std::is_same_v<T, int8_t>) {  // rounded to nearest even, packed to 8 bytes
      const __m256i q = _mm256_cvtps_epi32(_mm256_round_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), _mm_packs_epi16(w, w));
    } else {
      _mm256_store_ps(y + i, c);
      for (int u = 0; u < 8; ++u) dst[i + u] = static_cast<T>(y[i + u]);  // c10's e4m3 rounding
    }
  }
  for (; i < d; ++i) {
    const float c = std::min(qmax, std::max(-qmax, y[i] / sf));
    if constexpr (std::is_same_v<T, int8_t>) {
      dst[i] = static_cast<int8_t>(std::nearbyint(c));
    } else {
      dst[i] = static_cast<T>(c);
    }
  }
}

}  // namespace tpserve
