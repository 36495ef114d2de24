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

constexpr int kRows = 4;  // rows of W per tile: 4 independent memory streams

using tpserve::hsum;

// Dot products of kRows weight rows with R rows of x: each weight vector, loaded once, feeds R
// FMAs, and the kRows * R accumulators are independent chains (12 for R = 3: enough to keep both
// FMA ports busy through the 4-cycle latency, and with the 4 weight vectors and one x vector
// still within the 16 ymm registers; R = 4 spills).
template <int R>
inline void tile(const float* const w[kRows], const float* x, int64_t ldx, int64_t K, float out[R][kRows]) {
  __m256 acc[R][kRows];
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < kRows; ++n) acc[r][n] = _mm256_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[kRows];
    for (int n = 0; n < kRows; ++n) wv[n] = _mm256_loadu_ps(w[n] + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      for (int n = 0; n < kRows; ++n) acc[r][n] = _mm256_fmadd_ps(wv[n], xv, acc[r][n]);
    }
  }
  // Reduce with constant bounds only: a runtime loop touching acc[r][n] would make GCC keep the
  // accumulators in memory, storing all of them on every iteration above (2x slower, measured).
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < kRows; ++n) out[r][n] = hsum(acc[r][n]);
  }
  for (; k < K; ++k) {  // K % 8 tail
    for (int r = 0; r < R; ++r) {
      for (int n = 0; n < kRows; ++n) out[r][n] += w[n][k] * x[r * ldx + k];
    }
  }
}

// R rows of y from row m on, for the tile of W rows [n0, n0 + rows).
template <int R>
inline void tile_rows(const float* const w[kRows], int64_t rows, int64_t n0, int64_t m, int64_t K, int64_t N,
                      const float* x, const float* scale, const float* bias, float* y) {
  float out[R][kRows];
  tile<R>(w, x + m * K, K, K, out);
  for (int r = 0; r < R; ++r) {
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t n = n0 + i;
      y[(m + r) * N + n] = out[r][i] * (scale ? scale[n] : 1.0f) + (bias ? bias[n] : 0.0f);
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
  for (int64_t n0 = n_begin; n0 < n_end; n0 += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, n_end - n0);
    const float* w[kRows];
    for (int r = 0; r < kRows; ++r) {
      // A short last tile repeats its last row; the extra results are not written.
      w[r] = row(n0 + std::min<int64_t>(r, rows - 1), buffer.data() + r * K);
    }
    // W's tile is read from memory by the first group of x rows and from L1 by the others.
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) tile_rows<3>(w, rows, n0, m, K, N, x, scale, bias, y);
    if (M - m == 2) tile_rows<2>(w, rows, n0, m, K, N, x, scale, bias, y);
    if (M - m == 1) tile_rows<1>(w, rows, n0, m, K, N, x, scale, bias, y);
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

// y (M, N) = x @ W^T [* scale] [+ bias], W's rows split between the threads by whole tiles;
// `row(n, buffer)` gives W's row n as float32 (see run_rows).
template <typename RowFn>
at::Tensor linear(const at::Tensor& x, int64_t N, const float* scale, const c10::optional<at::Tensor>& bias,
                  RowFn row) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + kRows - 1) / kRows, grain_tiles(N), [&](int64_t t0, int64_t t1) {
    run_rows(t0 * kRows, std::min(N, t1 * kRows), M, K, N, xp, scale, bp, yp, row);
  });
  return y;
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_inputs(x, w, bias);
  TORCH_CHECK(w.scalar_type() == at::kFloat, "tpserve linear_f32: weight must be float32");
  const float* wp = w.data_ptr<float>();
  const int64_t K = w.size(1);
  return linear(x, w.size(0), nullptr, bias, [=](int64_t n, float*) { return wp + n * K; });
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  check_inputs(x, qw, bias);
  TORCH_CHECK(qw.scalar_type() == at::kChar, "tpserve linear_int8: weight must be int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == qw.size(0),
              "tpserve linear_int8: scale must be a contiguous float32 (N,) tensor");
  const int8_t* qp = qw.data_ptr<int8_t>();
  const int64_t K = qw.size(1);
  return linear(x, qw.size(0), scale.data_ptr<float>(), bias, [=](int64_t n, float* buf) {
    widen_row(qp + n * K, K, buf);  // int8 row -> float32 in this thread's L1 buffer
    return static_cast<const float*>(buf);
  });
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
