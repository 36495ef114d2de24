// Weight-only FP8 linear layers on AVX-512 CPUs: y (M, N) = x (M, K) @ W (N, K)^T [+ bias (N,)], W stored as
// float8 e4m3 (1 byte a weight) with a float32 scale per row and group of G input columns.
//
// Why: an FP8 checkpoint dequantized at load runs at float32's speed and memory (4 bytes a weight); kept as
// e4m3 it is read at 1 byte and converted in registers, never written back (the int8 kernel's pattern).
//
// Layout (worker/layers/fp8_weights.py fills it from the checkpoint):
//   weight (N, K) float8_e4m3fn, row-major;
//   scale (N, K / G) float32: w[n, k] = e4m3(weight[n, k]) * scale[n, k / G] (a checkpoint's 128 x 128 block
//     scales expanded over their rows; per channel: G = K). G % 16 == 0.
//
// The conversion: a code sign-extended to 16 bits, shifted left by 7 and masked with 0xBF80 is the float16 whose
// sign, exponent and mantissa bits are the code's, i.e. the value times 2^-8 (the exponent biases differ by 8);
// e4m3's subnormals become float16 subnormals of the same mantissa, and vcvtph2ps widens all of them to normal
// float32 exactly; each group's sum is scaled by s 2^8 (a power of two: exact). 4 instructions per 16 weights.
// (The fp8 KV cache's move into a float32 directly, times 2^-120, is one fewer, but makes the subnormal codes
// float32 subnormals: every FMA with one took a microcode assist, 9x the time on weights a quarter subnormal.)
// NaN codes (0x7F, 0xFF) are not decoded as NaN: checkpoints hold none.
//
// Rows of x: up to kMaxRows a pass (each converted vector of W feeds up to 8 FMAs), each thread owning a range of W's rows and reading S of them side by side
// (several sequential streams in flight, as the int8 streamed GEMV); more rows in passes of kMaxRows up to
// kChunkedMaxRows; beyond (prefill-sized), or without AVX-512, W is dequantized once and multiplied by at::matmul.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_linear.h"
#include "row_streams.h"

#include <algorithm>
#include <cstdint>

namespace tpserve_fp8 {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kChunkedMaxRows = 64;
constexpr int64_t kAhead = 1024;  // bytes prefetched ahead in each stream
constexpr float kTwo8 = 256.0f;  // the float16's 2^-8, undone per group

#define TPSERVE_FP8_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw")))

// Streams of W rows per thread for R rows of x: (accumulator + total) * S * R + R x vectors within 32 zmm.
constexpr int streams(int R) { return R <= 2 ? 4 : (R <= 4 ? 2 : 1); }

struct Args {
  int64_t K, N, G, groups;
  const float* x;      // (R, K)
  const int8_t* w;     // (N, K) e4m3 codes
  const float* scale;  // (N, groups)
  const float* bias;   // (N,) or nullptr
  float* y;            // (R, N), row stride N
};

template <int R, int S>
TPSERVE_FP8_AVX512 inline void dots(const int64_t rows[S], const Args& a) {
  const int8_t* wr[S];
  __m512 total[S][R];
  for (int s = 0; s < S; ++s) {
    wr[s] = a.w + rows[s] * a.K;
    for (int r = 0; r < R; ++r) total[s][r] = _mm512_setzero_ps();
  }
  const __m256i mask = _mm256_set1_epi16(static_cast<short>(0xBF80));
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512 acc[S][R];
    for (int s = 0; s < S; ++s) {
      for (int r = 0; r < R; ++r) acc[s][r] = _mm512_setzero_ps();
    }
    for (int64_t k = g * a.G; k < (g + 1) * a.G; k += 16) {
      __m512 xv[R];
      for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(a.x + r * a.K + k);
      for (int s = 0; s < S; ++s) {
        const int8_t* p = wr[s] + k;
        if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead), _MM_HINT_T0);
        const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        const __m512 wv = _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(v, 7), mask));  // w 2^-8
        for (int r = 0; r < R; ++r) acc[s][r] = _mm512_fmadd_ps(wv, xv[r], acc[s][r]);
      }
    }
    for (int s = 0; s < S; ++s) {
      const __m512 sc = _mm512_set1_ps(a.scale[rows[s] * a.groups + g] * kTwo8);
      for (int r = 0; r < R; ++r) total[s][r] = _mm512_fmadd_ps(acc[s][r], sc, total[s][r]);
    }
  }
  for (int s = 0; s < S; ++s) {
    const int64_t n = rows[s];
    for (int r = 0; r < R; ++r) a.y[r * a.N + n] = _mm512_reduce_add_ps(total[s][r]) + (a.bias ? a.bias[n] : 0.0f);
  }
}

// W's rows [n_begin, n_end) in streams(R) streams side by side (row_streams.h).
template <int R>
void run(int64_t n_begin, int64_t n_end, const Args& a) {
  tpserve::stream_rows<streams(R)>(n_begin, n_end, [&](const int64_t* rows, auto s) {
    dots<R, decltype(s)::value>(rows, a);
  });
}

using tpserve::cpu_has_avx512bw;

void check(const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(weight.device().is_cpu() && scale.device().is_cpu(), "tpserve fp8: tensors must be on the CPU");
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn && weight.dim() == 2 && weight.is_contiguous(),
              "tpserve fp8: weight must be a contiguous float8_e4m3fn (N, K) tensor");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 2 && scale.is_contiguous() &&
                  scale.size(0) == weight.size(0) && scale.size(1) > 0 && weight.size(1) % scale.size(1) == 0,
              "tpserve fp8: scale must be a contiguous float32 (N, K / G) tensor");
}

// W as float32 (N, K): e4m3 * scale per row and group.
at::Tensor dequantize_fp8(const at::Tensor& weight, const at::Tensor& scale) {
  check(weight, scale);
  const int64_t N = weight.size(0), K = weight.size(1), groups = scale.size(1);
  return weight.to(at::kFloat).view({N, groups, K / groups}).mul(scale.unsqueeze(2)).view({N, K});
}

// R rows of x (R <= kMaxRows), W's rows [n0, n1).
void rows_pass(int64_t R, int64_t n0, int64_t n1, const Args& a) {
  switch (R) {
    case 1: run<1>(n0, n1, a); break;
    case 2: run<2>(n0, n1, a); break;
    case 3: run<3>(n0, n1, a); break;
    case 4: run<4>(n0, n1, a); break;
    case 5: run<5>(n0, n1, a); break;
    case 6: run<6>(n0, n1, a); break;
    case 7: run<7>(n0, n1, a); break;
    default: run<8>(n0, n1, a); break;
  }
}

at::Tensor linear_fp8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "tpserve linear_fp8: x must be a contiguous float32 (M, K) CPU tensor");
  check(weight, scale);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), groups = scale.size(1), G = K / groups;
  TORCH_CHECK(weight.size(1) == K, "tpserve linear_fp8: x has ", K, " columns, weight ", weight.size(1));
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "tpserve linear_fp8: bias must be a contiguous float32 (N,) tensor");
  }
  if (M > kChunkedMaxRows || G % 16 != 0 || !cpu_has_avx512bw()) {
    at::Tensor y = at::matmul(x, dequantize_fp8(weight, scale).t());
    return bias.has_value() ? y.add_(*bias) : y;
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, N / (4 * at::get_num_threads()));
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int64_t rows = std::min(kMaxRows, M - m0);
    const Args a{K, N, G, groups, xp + m0 * K, reinterpret_cast<const int8_t*>(weight.data_ptr()),
                 scale.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                 y.data_ptr<float>() + m0 * N};
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { rows_pass(rows, n0, n1, a); });
  }
  return y;
}

}  // namespace tpserve_fp8

namespace tpserve {

bool fp8_rows_take(int64_t M, int64_t G) {
  return M >= 1 && M <= tpserve_fp8::kMaxRows && G % 16 == 0 && tpserve::cpu_has_avx512bw();
}

void fp8_rows(const float* x, int64_t M, int64_t K, int64_t N, int64_t G, const uint8_t* weight, const float* scale,
              const float* bias, float* y, int64_t n0, int64_t n1) {
  if (n0 >= n1) return;
  tpserve_fp8::rows_pass(M, n0, n1, tpserve_fp8::Args{K, N, G, K / G, x, reinterpret_cast<const int8_t*>(weight),
                                                      scale, bias, y});
}

}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("linear_fp8(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
  m.def("dequantize_fp8(Tensor weight, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) {
  m.impl("linear_fp8", &tpserve_fp8::linear_fp8);
  m.impl("dequantize_fp8", &tpserve_fp8::dequantize_fp8);
}
