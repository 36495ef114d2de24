// An 8-bit KV cache's codes and scales in registers (worker/kv_quant.py; read by cpu_attention.cpp):
// 8 codes at a time widened to float32, bfloat16 scales widened, and subnormals flushed while they are read.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace tpserve {

// Cache element types: float32, int8 codes, float8 e4m3 codes (their bits, as uint8).
struct Fp8E4M3 {
  uint8_t bits;
};

// 8 consecutive cache elements as floats (codes unscaled; the callers fold the scales in).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const Fp8E4M3* p) {
  // e4m3 bits s eeee mmm -> float32 bits s 0000eeee mmm 0...: the value times 2^(7 - 127) for normal
  // and subnormal codes alike (a subnormal code becomes a float32 subnormal of the same mantissa).
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7F)), 20);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(magnitude, sign)), _mm256_set1_ps(0x1p120f));
}

// One KV head's scales of an 8-bit cache, as float32 per position (k[t], v[t] for the t-th position of
// the row's `off`), and its d key offsets; nullptrs for float32.
struct ScaleRows {
  const float* k;
  const float* v;
  const float* offset;
};

// Subnormal floats flushed to zero (MXCSR's FTZ and DAZ) while a thread reads an 8-bit cache, the previous
// mode restored after: a far-from-max position's probability (exp(-86) ~ 1e-38) times its value's scale
// (~1e-2) is subnormal, and every FMA on a subnormal takes a microcode assist (random-code rows with
// scores spread over +-100: 2.2 ms a call instead of 0.1). What is flushed weighs < 1e-38 of the sum.
// A float32 cache keeps the mode it has (its results stay bit for bit the module path's).
class FlushSubnormals {
 public:
  explicit FlushSubnormals(bool on) : csr_(_mm_getcsr()) {
    if (on) _mm_setcsr(csr_ | 0x8040);
  }
  ~FlushSubnormals() { _mm_setcsr(csr_); }
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;

 private:
  unsigned int csr_;
};

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// n bfloat16 values -> float32 (their bits become the top half of a float32's), 8 at a time.
inline void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
  }
  for (; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

}  // namespace tpserve
