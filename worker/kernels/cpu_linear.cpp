// Decode-sized linear layers on AVX2 CPUs: y (M, N) = x (M, K) @ W (N, K)^T [* scale (N,)] [+ bias (N,)].
//
// Why a kernel of our own: a decode step multiplies a few rows of activations by every weight
// matrix, so its cost is streaming the weights from memory once. MKL's sgemm/sgemv for M = 1..16
// reads them at about half of what a plain streaming loop reaches on the 2-core AMD hosts we test on
// (benchmarks/README.md). Here each thread owns a contiguous range of W's rows, reads each row
// once and multiplies it into every row of x while it is in L1 (x stays in L2), so W crosses the
// memory bus exactly once per step whatever M is. Weights are float32, or int8 with one float32
// scale per output row (symmetric per-channel weight-only quantization: W ~= scale[n] * Wq[n, :]);
// int8 rows are widened to float32 in a per-thread buffer and the scale is applied to each dot
// product, so activations and accumulation stay float32.
//
// Threads: ATen's intra-op pool (at::parallel_for), so torch.set_num_threads governs it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <immintrin.h>

#include "vec_math.h"

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kRows = 4;  // rows of W per tile: 4 independent streams, 8 accumulators with 2 rows of x

using tpserve::hsum;

// Dot products of 4 weight rows with 1 row of x; two accumulators per row so 8 FMA chains are
// in flight (FMA latency 4 cycles x 2 ports).
inline void tile_4x1(const float* const w[kRows], const float* x, int64_t K, float out[kRows]) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w[0] + k), x0, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w[1] + k), x0, a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w[2] + k), x0, a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w[3] + k), x0, a3);
    b0 = _mm256_fmadd_ps(_mm256_loadu_ps(w[0] + k + 8), x1, b0);
    b1 = _mm256_fmadd_ps(_mm256_loadu_ps(w[1] + k + 8), x1, b1);
    b2 = _mm256_fmadd_ps(_mm256_loadu_ps(w[2] + k + 8), x1, b2);
    b3 = _mm256_fmadd_ps(_mm256_loadu_ps(w[3] + k + 8), x1, b3);
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 x0 = _mm256_loadu_ps(x + k);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w[0] + k), x0, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w[1] + k), x0, a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w[2] + k), x0, a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w[3] + k), x0, a3);
  }
  out[0] = hsum(_mm256_add_ps(a0, b0));
  out[1] = hsum(_mm256_add_ps(a1, b1));
  out[2] = hsum(_mm256_add_ps(a2, b2));
  out[3] = hsum(_mm256_add_ps(a3, b3));
  for (; k < K; ++k) {
    for (int r = 0; r < kRows; ++r) out[r] += w[r][k] * x[k];
  }
}

// 4 weight rows with 2 rows of x: each weight vector loaded once feeds two FMAs.
inline void tile_4x2(const float* const w[kRows], const float* x0p, const float* x1p, int64_t K,
                     float out0[kRows], float out1[kRows]) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 x0 = _mm256_loadu_ps(x0p + k), x1 = _mm256_loadu_ps(x1p + k);
    const __m256 w0 = _mm256_loadu_ps(w[0] + k), w1 = _mm256_loadu_ps(w[1] + k);
    const __m256 w2 = _mm256_loadu_ps(w[2] + k), w3 = _mm256_loadu_ps(w[3] + k);
    a0 = _mm256_fmadd_ps(w0, x0, a0);
    a1 = _mm256_fmadd_ps(w1, x0, a1);
    a2 = _mm256_fmadd_ps(w2, x0, a2);
    a3 = _mm256_fmadd_ps(w3, x0, a3);
    c0 = _mm256_fmadd_ps(w0, x1, c0);
    c1 = _mm256_fmadd_ps(w1, x1, c1);
    c2 = _mm256_fmadd_ps(w2, x1, c2);
    c3 = _mm256_fmadd_ps(w3, x1, c3);
  }
  out0[0] = hsum(a0); out0[1] = hsum(a1); out0[2] = hsum(a2); out0[3] = hsum(a3);
  out1[0] = hsum(c0); out1[1] = hsum(c1); out1[2] = hsum(c2); out1[3] = hsum(c3);
  for (; k < K; ++k) {
    for (int r = 0; r < kRows; ++r) {
      out0[r] += w[r][k] * x0p[k];
      out1[r] += w[r][k] * x1p[k];
    }
  }
}

// int8 -> float32, 8 at a time (vpmovsxbd + vcvtdq2ps).
inline void widen_row(const int8_t* q, int64_t K, float* dst) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k));
    _mm256_storeu_ps(dst + k, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
  }
  for (; k < K; ++k) dst[k] = static_cast<float>(q[k]);
}

// y rows [0, M) x columns [n_begin, n_end), tile by tile. `row(n, buffer)` returns a pointer to
// W's row n as float32 (the row itself, or its widened copy in `buffer`).
template <typename RowFn>
void run_rows(int64_t n_begin, int64_t n_end, int64_t M, int64_t K, int64_t N, const float* x,
              const float* scale, const float* bias, float* y, RowFn row) {
  std::vector<float> buffer(static_cast<size_t>(kRows * K));
  float out0[kRows], out1[kRows];
  for (int64_t n0 = n_begin; n0 < n_end; n0 += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, n_end - n0);
    const float* w[kRows];
    for (int r = 0; r < kRows; ++r) {
      // A short last tile repeats its last row; the extra results are not written.
      w[r] = row(n0 + std::min<int64_t>(r, rows - 1), buffer.data() + r * K);
    }
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) {
      tile_4x2(w, x + m * K, x + (m + 1) * K, K, out0, out1);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = n0 + r;
        const float s = scale ? scale[n] : 1.0f, b = bias ? bias[n] : 0.0f;
        y[m * N + n] = out0[r] * s + b;
        y[(m + 1) * N + n] = out1[r] * s + b;
      }
    }
    if (m < M) {
      tile_4x1(w, x + m * K, K, out0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = n0 + r;
        y[m * N + n] = out0[r] * (scale ? scale[n] : 1.0f) + (bias ? bias[n] : 0.0f);
      }
    }
  }
}

void check_inputs(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "tpserve cpu_linear: tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "tpserve cpu_linear: x (M, K) and weight (N, K) must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "tpserve cpu_linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) == w.size(1), "tpserve cpu_linear: x has K=", x.size(1), ", weight has K=", w.size(1));
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "tpserve cpu_linear: x and weight must be contiguous");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.size(0),
                "tpserve cpu_linear: bias must be a contiguous float32 (N,) tensor");
  }
}

// Whole tiles per task, and enough of them that each thread streams a long run of W.
int64_t grain_tiles(int64_t N) { return std::max<int64_t>(1, (N / kRows) / (4 * at::get_num_threads())); }

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_inputs(x, w, bias);
  TORCH_CHECK(w.scalar_type() == at::kFloat, "tpserve linear_f32: weight must be float32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kRows - 1) / kRows;
  at::parallel_for(0, tiles, grain_tiles(N), [&](int64_t t0, int64_t t1) {
    run_rows(t0 * kRows, std::min(N, t1 * kRows), M, K, N, xp, nullptr, bp, yp,
             [&](int64_t n, float*) { return wp + n * K; });
  });
  return y;
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  check_inputs(x, qw, bias);
  TORCH_CHECK(qw.scalar_type() == at::kChar, "tpserve linear_int8: weight must be int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == qw.size(0),
              "tpserve linear_int8: scale must be a contiguous float32 (N,) tensor");
  const int64_t M = x.size(0), K = x.size(1), N = qw.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qw.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kRows - 1) / kRows;
  at::parallel_for(0, tiles, grain_tiles(N), [&](int64_t t0, int64_t t1) {
    run_rows(t0 * kRows, std::min(N, t1 * kRows), M, K, N, xp, sp, bp, yp, [&](int64_t n, float* buf) {
      widen_row(qp + n * K, K, buf);
      return static_cast<const float*>(buf);
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(tpserve_cpu, m) {
  m.def("linear_f32(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor qweight, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) {
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_int8", &linear_int8);
}
