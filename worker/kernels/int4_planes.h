// What the int4 kernel's integer paths share: cpu_linear_int4.cpp's AVX512-VNNI path, the row-major AMX path
// (cpu_linear_int4_amx.cpp) and the tile layout's (cpu_linear_int4_tiles.cpp). Each cuts x, per chunk of 128
// columns, into three int8 planes, x ~= u (65536 xh + 256 xm + xl), u = max|x_chunk| / (127 * 65536) (docs/
// design/kernels.md, "int4": why three planes), laid out as its own dot products read them; the group sums of x
// (the offsets' factor); and, for the two AMX paths, the tile configuration loaded by ldtilecfg.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace tpserve_int4 {

#define TPSERVE_PLANES_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw")))

// max |x| over the 128 columns at xc (float32): the chunk's top, u = top / (127 * 65536).
TPSERVE_PLANES_AVX512 inline float chunk_max_abs(const float* xc) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < 128; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xc + k)));
  return _mm512_reduce_max_ps(amax);
}

// The planes' digits of 16 columns of x at x16 (float32) for the unit u (non-zero): v = round(x / u)
// (|v| <= 127 * 65536 < 2^24, exact in float32) split into balanced base-256 digits, each in [-128, 127],
// v = 65536 xh + 256 xm + xl exactly; one int32 lane a column.
TPSERVE_PLANES_AVX512 inline void plane_digits(const float* x16, __m512 u, __m512i& xh, __m512i& xm, __m512i& xl) {
  const __m512i half = _mm512_set1_epi32(128), byte = _mm512_set1_epi32(255);
  const __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(x16), u));
  xl = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, half), byte), half);
  const __m512i v1 = _mm512_srai_epi32(_mm512_sub_epi32(v, xl), 8);
  xm = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v1, half), byte), half);
  xh = _mm512_srai_epi32(_mm512_sub_epi32(v1, xm), 8);
}

// xsum[m * (K / G) + g] = sum of row m of x (M, K) over group g's G columns (G % 16 == 0), in 16 lanes.
TPSERVE_PLANES_AVX512 inline void group_sums512(const float* x, int64_t M, int64_t K, int64_t G, float* xsum) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < K / G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + m * K + k));
      xsum[m * (K / G) + g] = _mm512_reduce_add_ps(acc);
    }
  }
}

// ldtilecfg's 64-byte operand (palette 1): per tile register t, rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace tpserve_int4
