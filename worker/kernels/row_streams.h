// What the weight-only linear kernels share (cpu_linear_int4.cpp, cpu_linear_w8.cpp, cpu_linear_fp8.cpp): the
// CPU check for their 512-bit paths and the walk over W's rows that keeps several sequential streams in flight.
#pragma once
#include <cstdint>
#include <type_traits>

namespace tpserve {

// Whether this CPU has the AVX-512 subsets the 512-bit paths use (F, VL, BW); asked once.
inline bool cpu_has_avx512bw() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512bw");
  return has;
}

// W's rows [n_begin, n_end) cut into S contiguous parts read side by side (S sequential streams for the hardware
// prefetchers, one dot product each in registers), the remainder one by one:
// dots(rows, std::integral_constant<int, S>{}) with rows[S] = {n_begin + s * part + i}, then
// dots(rows, std::integral_constant<int, 1>{}) per leftover row.
template <int S, class Dots>
inline void stream_rows(int64_t n_begin, int64_t n_end, Dots&& dots) {
  const int64_t part = (n_end - n_begin) / S;
  for (int64_t i = 0; i < part; ++i) {
    int64_t rows[S];
    for (int s = 0; s < S; ++s) rows[s] = n_begin + s * part + i;
    dots(rows, std::integral_constant<int, S>{});
  }
  for (int64_t n = n_begin + S * part; n < n_end; ++n) {
    const int64_t rows[1] = {n};
    dots(rows, std::integral_constant<int, 1>{});
  }
}

}  // namespace tpserve
