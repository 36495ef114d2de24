// The float paths of the grouped weight-only linear kernels (cpu_linear_int4.cpp: 4-bit codes, cpu_linear_w8.cpp:
// 8-bit codes), written once over a "codes" policy that says how a step's codes are read and widened to float32.
//
// Both compute y (M, N) = x (M, K) @ W (N, K)^T [+ bias (N,)] with w = s_g * q + o_g per row of W and group g
// of G input columns, as sum_g [ s_g * sum_{k in g} q_k x_k + o_g * xsum_g ], xsum_g = sum_{k in g} x_k once
// per call: q_k x_k summed in a vector per (row of W, row of x), scaled by s_g once a group (not an FMA a
// weight). Rows of x: up to Codes::kMaxRows512 (AVX-512) or Codes::kMaxRows256 (AVX2) at once, each thread
// owning a range of W's rows and reading S of them side by side (row_streams.h; S by the register budget);
// more rows of x in chunks of that many, W re-read per chunk (group_linear).
//
// A Codes policy holds (all static):
//   kCodesPerByte   1 (a byte a code) or 2 (two nibbles a byte): a row of W is K / kCodesPerByte bytes and
//                   column k's codes start at byte k / kCodesPerByte (k a multiple of kStep);
//   kStep           columns a step reads, a multiple of 16;
//   kMaxRows512, kMaxRows256   rows of x a pass on each path (at most 8; kMaxRows256 <= kMaxRows512);
//   widen512(p, w)  the kStep codes at p as kStep / 16 __m512 of float32, columns 16 v .. 16 v + 15 in w[v]
//                   (TPSERVE_GROUP_AVX512);
//   widen256(p, w)  the same as kStep / 8 __m256, columns 8 v .. 8 v + 7 in w[v].
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/matmul.h>
#include <c10/util/Optional.h>

#include <immintrin.h>

#include "row_streams.h"
#include "vec_math.h"

#include <algorithm>
#include <cstdint>

namespace tpserve {

#define TPSERVE_GROUP_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw")))

constexpr int64_t kGroupAhead = 2048;  // bytes of codes prefetched ahead in each stream

// One pass: R rows of x against rows of W.
struct GroupArgs {
  int64_t K, N, G, groups;
  const float* x;        // (R, K), row stride K
  const float* xsum;     // (R, groups)
  const uint8_t* w;      // (N, K / Codes::kCodesPerByte)
  const float* so;       // (N, groups, 2): (scale, offset) per row and group
  const float* bias;     // (N,) or nullptr
  float* y;              // (R, N), row stride N
};

// Streams of W rows per thread for R rows of x: (accumulator + total) * S * R + the x and weight vectors
// within 32 zmm registers (16 ymm for AVX2).
constexpr int group_streams512(int R) { return R <= 2 ? 4 : (R <= 4 ? 2 : 1); }
constexpr int group_streams256(int R) { return R <= 1 ? 2 : 1; }

// y[r, n] for R rows of x and the S rows of W in rows[], 512-bit vectors.
template <class Codes, int R, int S>
TPSERVE_GROUP_AVX512 inline void group_dots512(const int64_t rows[S], const GroupArgs& a) {
  constexpr int V = Codes::kStep / 16;
  const uint8_t* wr[S];
  const float* sr[S];
  __m512 total[S][R];
  float offset[S][R];
  for (int s = 0; s < S; ++s) {
    wr[s] = a.w + rows[s] * (a.K / Codes::kCodesPerByte);
    sr[s] = a.so + rows[s] * a.groups * 2;
    for (int r = 0; r < R; ++r) {
      total[s][r] = _mm512_setzero_ps();
      offset[s][r] = 0.0f;
    }
  }
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512 acc[S][R];
    for (int s = 0; s < S; ++s) {
      for (int r = 0; r < R; ++r) acc[s][r] = _mm512_setzero_ps();
    }
    for (int64_t k = g * a.G; k < (g + 1) * a.G; k += Codes::kStep) {
      __m512 xv[R][V];
      for (int r = 0; r < R; ++r) {
        for (int v = 0; v < V; ++v) xv[r][v] = _mm512_loadu_ps(a.x + r * a.K + k + 16 * v);
      }
      for (int s = 0; s < S; ++s) {
        const uint8_t* p = wr[s] + k / Codes::kCodesPerByte;
        // One prefetch a 64-byte line of codes.
        if ((k & (64 * Codes::kCodesPerByte - 1)) == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(p + kGroupAhead), _MM_HINT_T0);
        }
        __m512 wv[V];
        Codes::widen512(p, wv);
        for (int r = 0; r < R; ++r) {
          for (int v = 0; v < V; ++v) acc[s][r] = _mm512_fmadd_ps(wv[v], xv[r][v], acc[s][r]);
        }
      }
    }
    for (int s = 0; s < S; ++s) {
      const __m512 scale = _mm512_set1_ps(sr[s][2 * g]);
      const float off = sr[s][2 * g + 1];
      for (int r = 0; r < R; ++r) {
        total[s][r] = _mm512_fmadd_ps(acc[s][r], scale, total[s][r]);
        offset[s][r] += off * a.xsum[r * a.groups + g];
      }
    }
  }
  for (int s = 0; s < S; ++s) {
    const int64_t n = rows[s];
    for (int r = 0; r < R; ++r) {
      a.y[r * a.N + n] = _mm512_reduce_add_ps(total[s][r]) + offset[s][r] + (a.bias ? a.bias[n] : 0.0f);
    }
  }
}

// The same with 256-bit vectors (AVX2), x read as it is used (16 ymm registers leave none to hold it).
template <class Codes, int R, int S>
inline void group_dots256(const int64_t rows[S], const GroupArgs& a) {
  constexpr int V = Codes::kStep / 8;
  const uint8_t* wr[S];
  const float* sr[S];
  __m256 total[S][R];
  float offset[S][R];
  for (int s = 0; s < S; ++s) {
    wr[s] = a.w + rows[s] * (a.K / Codes::kCodesPerByte);
    sr[s] = a.so + rows[s] * a.groups * 2;
    for (int r = 0; r < R; ++r) {
      total[s][r] = _mm256_setzero_ps();
      offset[s][r] = 0.0f;
    }
  }
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256 acc[S][R];
    for (int s = 0; s < S; ++s) {
      for (int r = 0; r < R; ++r) acc[s][r] = _mm256_setzero_ps();
    }
    for (int64_t k = g * a.G; k < (g + 1) * a.G; k += Codes::kStep) {
      for (int s = 0; s < S; ++s) {
        const uint8_t* p = wr[s] + k / Codes::kCodesPerByte;
        if ((k & (64 * Codes::kCodesPerByte - 1)) == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(p + kGroupAhead), _MM_HINT_T0);
        }
        __m256 wv[V];
        Codes::widen256(p, wv);
        for (int r = 0; r < R; ++r) {
          for (int v = 0; v < V; ++v) {
            acc[s][r] = _mm256_fmadd_ps(wv[v], _mm256_loadu_ps(a.x + r * a.K + k + 8 * v), acc[s][r]);
          }
        }
      }
    }
    for (int s = 0; s < S; ++s) {
      const __m256 scale = _mm256_set1_ps(sr[s][2 * g]);
      const float off = sr[s][2 * g + 1];
      for (int r = 0; r < R; ++r) {
        total[s][r] = _mm256_fmadd_ps(acc[s][r], scale, total[s][r]);
        offset[s][r] += off * a.xsum[r * a.groups + g];
      }
    }
  }
  for (int s = 0; s < S; ++s) {
    const int64_t n = rows[s];
    for (int r = 0; r < R; ++r) {
      a.y[r * a.N + n] = hsum(total[s][r]) + offset[s][r] + (a.bias ? a.bias[n] : 0.0f);
    }
  }
}

// W's rows [n0, n1) against R rows of x, in S streams side by side (row_streams.h).
template <class Codes, int R>
void group_run_rows(int64_t n0, int64_t n1, const GroupArgs& a, bool wide) {
  if (wide) {
    stream_rows<group_streams512(R)>(n0, n1, [&](const int64_t* rows, auto streams) {
      group_dots512<Codes, R, decltype(streams)::value>(rows, a);
    });
  } else if constexpr (R <= Codes::kMaxRows256) {
    stream_rows<group_streams256(R)>(n0, n1, [&](const int64_t* rows, auto streams) {
      group_dots256<Codes, R, decltype(streams)::value>(rows, a);
    });
  }
}

// xsum[m * (K / G) + g] = sum of row m of x over group g's G columns, in order (the AVX2 path's sums).
inline void group_sums(const float* x, int64_t M, int64_t K, int64_t G, float* xsum) {
  const int64_t groups = K / G;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += x[m * K + k];
      xsum[m * groups + g] = sum;
    }
  }
}

// y (M, N), row stride N, from x (M, K), the codes w, scale_offset so (N, K / G, 2), bias (N,) or nullptr
// and xsum (M, K / G) (group_sums): passes of up to Codes::kMaxRows512 rows of x (wide: AVX-512) or
// Codes::kMaxRows256 (AVX2), W's rows split among the threads.
template <class Codes>
void group_linear(const float* x, int64_t M, int64_t K, int64_t N, int64_t G, const float* xsum, const uint8_t* w,
                  const float* so, const float* bias, float* y, bool wide) {
  static_assert(Codes::kMaxRows256 <= Codes::kMaxRows512 && Codes::kMaxRows512 <= 8);
  const int64_t groups = K / G;
  const int64_t step = wide ? Codes::kMaxRows512 : Codes::kMaxRows256;
  const int64_t grain = std::max<int64_t>(1, N / (4 * at::get_num_threads()));
  for (int64_t m0 = 0; m0 < M; m0 += step) {
    const int64_t rows = std::min(step, M - m0);
    const GroupArgs a{K, N, G, groups, x + m0 * K, xsum + m0 * groups, w, so, bias, y + m0 * N};
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      switch (rows) {
        case 1: group_run_rows<Codes, 1>(n0, n1, a, wide); break;
        case 2: group_run_rows<Codes, 2>(n0, n1, a, wide); break;
        case 3: group_run_rows<Codes, 3>(n0, n1, a, wide); break;
        case 4: group_run_rows<Codes, 4>(n0, n1, a, wide); break;
        case 5: group_run_rows<Codes, 5>(n0, n1, a, wide); break;
        case 6: group_run_rows<Codes, 6>(n0, n1, a, wide); break;
        case 7: group_run_rows<Codes, 7>(n0, n1, a, wide); break;
        default: group_run_rows<Codes, 8>(n0, n1, a, wide); break;
      }
    });
  }
}

// A prefill-sized product (compute-bound, so W is dequantized once): x (M, K) @ w_float (N, K)^T [+ bias].
inline at::Tensor dequantized_matmul(const at::Tensor& x, const at::Tensor& w_float,
                                     const c10::optional<at::Tensor>& bias) {
  at::Tensor y = at::matmul(x, w_float.t());
  return bias.has_value() ? y.add_(*bias) : y;
}

}  // namespace tpserve
