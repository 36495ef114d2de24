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
// The sum, per row of W and row of x (the int4 kernel's float paths, cpu_linear_int4.cpp, written once in
// group_dots.h over a "codes" policy: Codes below, a byte a code):
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
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_linear_w8.h"
#include "group_dots.h"
#include "row_streams.h"

#include <atomic>
#include <cstdint>
#include <vector>

namespace tpserve_w8 {

constexpr int64_t kGroupMultiple = 32;   // columns: G and K are multiples of it
constexpr int64_t kChunkedMaxRows = 64;  // beyond: dequantize W once and at::matmul

// The codes for group_dots.h: 16 columns a step, one byte each.
struct Codes {
  static constexpr int64_t kCodesPerByte = 1;
  static constexpr int64_t kStep = 16;
  static constexpr int64_t kMaxRows512 = 4;  // rows of x per pass, AVX-512 (measured: 8 at once, one stream, is slower)
  static constexpr int64_t kMaxRows256 = 4;  // rows of x per pass, AVX2

  TPSERVE_GROUP_AVX512 static inline void widen512(const uint8_t* p, __m512 w[1]) {
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static inline void widen256(const uint8_t* p, __m256 w[2]) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));  // columns k .. k + 15
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
  }
};

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

bool region_takes(int64_t M) {
  return M >= 1 && M <= kChunkedMaxRows && allow_wide.load(std::memory_order_relaxed) && cpu_has_avx512bw();
}

void region_rows(const float* x, int64_t M, int64_t K, int64_t N, int64_t G, const uint8_t* qweight,
                 const float* scale_offset, const float* bias, float* y, int64_t n0, int64_t n1) {
  if (n0 >= n1) return;
  const int64_t groups = K / G;
  thread_local std::vector<float> xsum;
  xsum.resize(static_cast<size_t>(M * groups));
  tpserve::group_sums(x, M, K, G, xsum.data());
  // group_linear's passes (AVX-512: Codes::kMaxRows512 rows of x each), on W's rows [n0, n1) only.
  for (int64_t m0 = 0; m0 < M; m0 += Codes::kMaxRows512) {
    const int64_t rows = std::min(Codes::kMaxRows512, M - m0);
    const tpserve::GroupArgs a{K, N, G, groups, x + m0 * K, xsum.data() + m0 * groups, qweight, scale_offset, bias,
                               y + m0 * N};
    switch (rows) {
      case 1: tpserve::group_run_rows<Codes, 1>(n0, n1, a, true); break;
      case 2: tpserve::group_run_rows<Codes, 2>(n0, n1, a, true); break;
      case 3: tpserve::group_run_rows<Codes, 3>(n0, n1, a, true); break;
      default: tpserve::group_run_rows<Codes, 4>(n0, n1, a, true); break;
    }
  }
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
    return tpserve::dequantized_matmul(x, dequantize_w8(qweight, scale_offset), bias);
  }
  const int64_t groups = scale_offset.size(1), G = K / groups;
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum(static_cast<size_t>(M * groups));  // per row of x and group: the offsets' factor
  tpserve::group_sums(xp, M, K, G, xsum.data());
  const bool wide = allow_wide.load(std::memory_order_relaxed) && cpu_has_avx512bw();
  tpserve::group_linear<Codes>(xp, M, K, N, G, xsum.data(), qweight.data_ptr<uint8_t>(),
                               scale_offset.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                               y.data_ptr<float>(), wide);
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
