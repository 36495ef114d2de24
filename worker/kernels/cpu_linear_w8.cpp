// Weight-only 8-bit linear layers with group-wise scales and offsets, on AVX2 and AVX-512 CPUs:
// y (M, N) = x (M, K) @ W (N, K)^T [+ bias (N,)], W stored as byte codes with a float32 scale and offset per
// group of G input columns: the form of published group-wise or asymmetric 8-bit checkpoints (GPTQ bits 8,
// compressed-tensors W8A16; worker/layers/int8_groups.py converts them at load, exactly).
//
// Why: a decode step streams every weight matrix from memory once, so its time is the bytes read. The
// int8 kernel (cpu_linear.cpp) takes one scale per output row and no offset; group-wise 8-bit codes need a
// scale and an offset per group. Codes are widened to float32 in registers, never written back: 8 bits a
// weight plus 64 / G bits of scale and offset (8.5 at G = 128).
//
// Layout:
//   qweight (N, K) uint8: the codes q in [0, 255], row-major (one output row per row).
//   scale_offset (N, K / G, 2) float32: per row and group, (s, o) with w = s * q + o (o = -s * z for a zero
//     point z). G is a multiple of 32 dividing K.
//
// The sum, per row of W and row of x (as the int4 kernel's float paths, cpu_linear_int4.cpp):
// sum_g [ s_g * sum_{k in g} q_k x_k + o_g * xsum_g ], xsum_g = sum_{k in g} x_k once per call; q_k x_k is
// summed in a vector per (row of W, row of x), scaled by s_g once a group (not an FMA a weight).
//
// Rows of x: up to kMaxRows512 (AVX-512) or kMaxRows256 (AVX2) at once, each thread owning a range of W's
// rows and reading S of them side by side (several sequential streams in flight; S by the register
// budget). More rows of x are taken in chunks of that many (W re-read per chunk) up to kChunkedMaxRows;
// beyond, a prefill-sized product, W is dequantized once to float32 and multiplied by at::matmul.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <immintrin.h>

#include "row_streams.h"
#include "vec_math.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace tpserve_w8 {

constexpr int64_t kGroupMultiple = 32;   // columns: G and K are multiples of it
constexpr int64_t kMaxRows512 = 4;       // rows of x per pass, AVX-512 (measured: 8 at once, one stream, is slower)
constexpr int64_t kMaxRows256 = 4;       // rows of x per pass, AVX2
constexpr int64_t kChunkedMaxRows = 64;  // beyond: dequantize W once and at::matmul
constexpr int64_t kAhead = 2048;         // bytes prefetched ahead in each stream

#define TPSERVE_W8_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw")))

// Streams of W rows per thread for R rows of x: (accumulator + total) * S * R + R x vectors + 1 weight vector
// within 32 zmm registers (16 ymm for AVX2).
constexpr int streams512(int R) { return R <= 2 ? 4 : (R <= 4 ? 2 : 1); }
constexpr int streams256(int R) { return R <= 1 ? 2 : 1; }

struct Args {
  int64_t K, N, G, groups;
  const float* x;        // (R, K), row stride K
  const float* xsum;     // (R, groups)
  const uint8_t* w;      // (N, K)
  const float* so;       // (N, groups, 2)
  const float* bias;     // (N,) or nullptr
  float* y;              // (R, N), row stride N
};

template <int R, int S>
TPSERVE_W8_AVX512 inline void dots512(const int64_t rows[S], const Args& a) {
  const uint8_t* wr[S];
  const float* sr[S];
  __m512 total[S][R];
  float offset[S][R];
  for (int s = 0; s < S; ++s) {
    wr[s] = a.w + rows[s] * a.K;
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
    for (int64_t k = g * a.G; k < (g + 1) * a.G; k += 16) {
      __m512 xv[R];
      for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(a.x + r * a.K + k);
      for (int s = 0; s < S; ++s) {
        const uint8_t* p = wr[s] + k;
        if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead), _MM_HINT_T0);  // a line
        const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
        for (int r = 0; r < R; ++r) acc[s][r] = _mm512_fmadd_ps(wv, xv[r], acc[s][r]);
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

template <int R, int S>
inline void dots256(const int64_t rows[S], const Args& a) {
  const uint8_t* wr[S];
  const float* sr[S];
  __m256 total[S][R];
  float offset[S][R];
  for (int s = 0; s < S; ++s) {
    wr[s] = a.w + rows[s] * a.K;
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
    for (int64_t k = g * a.G; k < (g + 1) * a.G; k += 16) {
      for (int s = 0; s < S; ++s) {
        const uint8_t* p = wr[s] + k;
        if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead), _MM_HINT_T0);
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));  // columns k .. k + 15
        const __m256 wlo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
        const __m256 whi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
        for (int r = 0; r < R; ++r) {
          acc[s][r] = _mm256_fmadd_ps(wlo, _mm256_loadu_ps(a.x + r * a.K + k), acc[s][r]);
          acc[s][r] = _mm256_fmadd_ps(whi, _mm256_loadu_ps(a.x + r * a.K + k + 8), acc[s][r]);
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
      a.y[r * a.N + n] = tpserve::hsum(total[s][r]) + offset[s][r] + (a.bias ? a.bias[n] : 0.0f);
    }
  }
}

// W's rows [n_begin, n_end) in S streams side by side (row_streams.h).
template <int R, int S, bool Wide>
void run(int64_t n_begin, int64_t n_end, const Args& a) {
  tpserve::stream_rows<S>(n_begin, n_end, [&](const int64_t* rows, auto streams) {
    if constexpr (Wide) dots512<R, decltype(streams)::value>(rows, a);
    else dots256<R, decltype(streams)::value>(rows, a);
  });
}

template <int R>
void run_rows(int64_t n0, int64_t n1, const Args& a, bool wide) {
  if (wide) {
    run<R, streams512(R), true>(n0, n1, a);
  } else if constexpr (R <= kMaxRows256) {
    run<R, streams256(R), false>(n0, n1, a);
  }
}

using tpserve::cpu_has_avx512bw;
std::atomic<bool> allow_wide{true};  // use_avx512_w8(False): the AVX2 path (tests, A/B runs)
bool use_avx512_w8(bool enabled) {
  allow_wide.store(enabled);
  return enabled && cpu_has_avx512bw();
}

void check(const at::Tensor& qweight, const at::Tensor& scale_offset) {
  TORCH_CHECK(qweight.device().is_cpu() && scale_offset.device().is_cpu(), "tpserve w8: tensors must be on the CPU");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "tpserve w8: qweight must be a contiguous uint8 (N, K) tensor");
  TORCH_CHECK(scale_offset.scalar_type() == at::kFloat && scale_offset.dim() == 3 && scale_offset.size(2) == 2 &&
                  scale_offset.is_contiguous() && scale_offset.size(0) == qweight.size(0),
              "tpserve w8: scale_offset must be a contiguous float32 (N, K / G, 2) tensor");
  const int64_t K = qweight.size(1), groups = scale_offset.size(1);
  TORCH_CHECK(groups > 0 && K % groups == 0 && (K / groups) % kGroupMultiple == 0, "tpserve w8: ", groups,
              " groups do not split K=", K, " into multiples of 32 columns");
}

// W as float32 (N, K): w = s * q + o.
at::Tensor dequantize_w8(const at::Tensor& qweight, const at::Tensor& scale_offset) {
  check(qweight, scale_offset);
  const int64_t N = qweight.size(0), K = qweight.size(1), groups = scale_offset.size(1), G = K / groups;
  at::Tensor w = at::empty({N, K}, scale_offset.options());
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const float* sp = scale_offset.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t k = 0; k < K; ++k) {
        const float* so = sp + (n * groups + k / G) * 2;
        wp[n * K + k] = so[0] * static_cast<float>(qp[n * K + k]) + so[1];
      }
    }
  });
  return w;
}

at::Tensor linear_w8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale_offset,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "tpserve linear_w8: x must be a contiguous float32 (M, K) CPU tensor");
  check(qweight, scale_offset);
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K, "tpserve linear_w8: x has ", K, " columns, qweight ", qweight.size(1));
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "tpserve linear_w8: bias must be a contiguous float32 (N,) tensor");
  }
  if (M > kChunkedMaxRows) {  // prefill-sized: compute-bound, so dequantize once and multiply
    at::Tensor y = at::matmul(x, dequantize_w8(qweight, scale_offset).t());
    return bias.has_value() ? y.add_(*bias) : y;
  }
  const int64_t groups = scale_offset.size(1), G = K / groups;
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum(static_cast<size_t>(M * groups));  // per row of x and group: the offsets' factor
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += xp[m * K + k];
      xsum[m * groups + g] = sum;
    }
  }
  const bool wide = allow_wide.load(std::memory_order_relaxed) && cpu_has_avx512bw();
  const int64_t step = wide ? kMaxRows512 : kMaxRows256;
  const int64_t grain = std::max<int64_t>(1, N / (4 * at::get_num_threads()));
  for (int64_t m0 = 0; m0 < M; m0 += step) {
    const int64_t rows = std::min(step, M - m0);
    const Args a{K, N, G, groups, xp + m0 * K, xsum.data() + m0 * groups, qweight.data_ptr<uint8_t>(),
                 scale_offset.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                 y.data_ptr<float>() + m0 * N};
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      switch (rows) {
        case 1: run_rows<1>(n0, n1, a, wide); break;
        case 2: run_rows<2>(n0, n1, a, wide); break;
        case 3: run_rows<3>(n0, n1, a, wide); break;
        case 4: run_rows<4>(n0, n1, a, wide); break;
        case 5: run_rows<5>(n0, n1, a, wide); break;
        case 6: run_rows<6>(n0, n1, a, wide); break;
        case 7: run_rows<7>(n0, n1, a, wide); break;
        default: run_rows<8>(n0, n1, a, wide); break;
      }
    });
  }
  return y;
}

}  // namespace tpserve_w8

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("linear_w8(Tensor x, Tensor qweight, Tensor scale_offset, Tensor? bias) -> Tensor");
  m.def("dequantize_w8(Tensor qweight, Tensor scale_offset) -> Tensor");
  m.def("use_avx512_w8(bool enabled) -> bool", &tpserve_w8::use_avx512_w8);
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) {
  m.impl("linear_w8", &tpserve_w8::linear_w8);
  m.impl("dequantize_w8", &tpserve_w8::dequantize_w8);
}
