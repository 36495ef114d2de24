// Decode-sized linear layers on AVX2 and AVX-512 CPUs: y (M, N) = x (M, K) @ W (N, K)^T [* scale (N,)] [+ bias (N,)].
//
// Why a kernel of our own: a decode step multiplies a few rows of activations by every weight
// matrix, so its cost is streaming the weights from memory once. MKL's sgemm/sgemv for M = 1..16
// reads them at about half of what a plain streaming loop reaches on the 2-core AMD hosts we test on
// (benchmarks/README.md). Here each thread owns a contiguous range of W's rows, reads each row
// once and multiplies it into every row of x while it is in L1 (x stays in L2), so W crosses the
// memory bus exactly once per step whatever M is. Weights are float32, or int8 with one float32
// scale per output row (symmetric per-channel weight-only quantization: W ~= scale[n] * Wq[n, :]);
// int8 weights are widened to float32 (in registers by the streamed GEMV, a row at a time into a
// per-thread buffer for the tiles) and the scale is applied to each dot product, so activations
// and accumulation stay float32.
//
// Two vector paths, picked at run time: AVX-512 where the CPU has it (6 rows of x per weight
// tile; on the 2-core Xeon host, the 95M benchmark model's projections at 16 rows take ~31 ms
// against MKL's 41-60 ms and the AVX2 path's 39 ms; up to 8 rows of x a streamed GEMV, run_seq512,
// and prefill-sized x in blocks of rows, see linear()), else AVX2 + FMA (3 rows per tile; up to 4
// rows of x the streamed GEMV in 8-float vectors, run_seq256).
//
// Threads: ATen's intra-op pool (at::parallel_for), so torch.set_num_threads governs it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_linear.h"
#include "vec_math.h"

#include <atomic>
#include <cstdint>
#include <vector>

namespace {

constexpr int kRows = 4;  // rows of W per tile: 4 independent memory streams

using tpserve::hsum;

// Dot products of kRows weight rows with R rows of x: each weight vector, loaded once, feeds R
// FMAs, and the kRows * R accumulators are independent chains (12 for R = 3: enough to keep both
// FMA ports busy through the 4-cycle latency, and with the 4 weight vectors and one x vector
// still within the 16 ymm registers; R = 4 spills).
// `next`: the following tile's rows (or nullptr), whose lines at the same offsets are prefetched
// while this tile computes, so the memory stream never waits on the FMAs (the AVX-512 path's
// prefetch, below; at M = 1 the hardware prefetchers alone lose each 4-row tile's 4 short streams).
template <int R>
inline void tile(const float* const w[kRows], const float* x, int64_t ldx, int64_t K, float out[R][kRows],
                 const float* const* next) {
  __m256 acc[R][kRows];
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < kRows; ++n) acc[r][n] = _mm256_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[kRows];
    for (int n = 0; n < kRows; ++n) wv[n] = _mm256_loadu_ps(w[n] + k);
    if (next && (k & 15) == 0) {  // one prefetch per 64-byte line
      for (int n = 0; n < kRows; ++n) _mm_prefetch(reinterpret_cast<const char*>(next[n] + k), _MM_HINT_T0);
    }
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

// ---- AVX-512 (Intel Skylake-SP and later, AMD Zen 4 and later) ----------------------------
// The same tiling with 16-float vectors and the 32 zmm registers: 6 rows of x per weight tile
// (24 accumulators + 4 weight vectors + 1 x vector = 29 registers), so each weight vector feeds 6
// FMAs and the loop is FMA-bound rather than load-bound. The K % 16 tail is a masked load (zeros
// past K), and the 4 sums of one x row are reduced together into one 128-bit store.
#define TPSERVE_AVX512 __attribute__((target("avx512f,avx512vl")))

// 16 weights from k on as float32: loaded, or (int8) widened (vpmovsxbd + vcvtdq2ps), or (bfloat16,
// float16) widened exactly: a bfloat16 is a float32's upper half (vpmovzxwd + vpslld 16), a float16
// converts with vcvtph2ps. So a 16-bit weight gives the bits of its float32 copy.
TPSERVE_AVX512 inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
TPSERVE_AVX512 inline __m512 load16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
TPSERVE_AVX512 inline __m512 load16(const c10::BFloat16* w) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
TPSERVE_AVX512 inline __m512 load16(const c10::Half* w) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}
// The last `count` (< 16) weights of a row, zeros past them: float32 by a masked load; a 16-bit type through
// a zeroed copy (the same values, and zeros where the masked load has them).
TPSERVE_AVX512 inline __m512 load16_tail(const float* w, int64_t, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, w);
}
template <typename T>
TPSERVE_AVX512 inline __m512 load16_tail(const T* w, int64_t count, __mmask16) {
  T tail[16] = {};
  for (int64_t i = 0; i < count; ++i) tail[i] = w[i];
  return load16(tail);
}


TPSERVE_AVX512 inline __m256 fold512(__m512 v) {  // lanes i + (i + 8): 16 -> 8 partial sums
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return _mm256_add_ps(_mm512_castps512_ps256(v), hi);
}

// [sum(a), sum(b), sum(c), sum(d)]
TPSERVE_AVX512 inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m256 ab = _mm256_hadd_ps(fold512(a), fold512(b));  // a01 a23 b01 b23 | a45 a67 b45 b67
  const __m256 cd = _mm256_hadd_ps(fold512(c), fold512(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);                 // a b c d (0..3) | a b c d (4..7)
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// `phase` of `groups`: the groups of x rows that meet one W tile share the next tile's prefetches,
// this one issuing those of the 16-float steps s with s % groups == phase, so that the memory stream
// runs while every group computes, not only the first (M = 16 on one Zen 5 core: see linear()).
// W float32, or bfloat16 / float16 widened in registers by load16 (the same values, so the same bits).
template <int R, typename T>
TPSERVE_AVX512 inline void tile512(const T* const w[kRows], const float* x, int64_t ldx, int64_t K,
                                   __m128 out[R], const T* const* next, int phase, int groups) {
  __m512 acc[R][kRows];
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < kRows; ++n) acc[r][n] = _mm512_setzero_ps();
  }
  int64_t k = 0;
  int slot = (groups - phase) % groups;  // 0 on this group's steps
  for (; k + 16 <= K; k += 16) {
    __m512 wv[kRows];
    for (int n = 0; n < kRows; ++n) wv[n] = load16(w[n] + k);
    if (next && slot == 0) {  // fetch the next tile's line at the same offset while this one computes
      for (int n = 0; n < kRows; ++n) _mm_prefetch(reinterpret_cast<const char*>(next[n] + k), _MM_HINT_T0);
    }
    if (++slot == groups) slot = 0;
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
      for (int n = 0; n < kRows; ++n) acc[r][n] = _mm512_fmadd_ps(wv[n], xv, acc[r][n]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[kRows];
    for (int n = 0; n < kRows; ++n) wv[n] = load16_tail(w[n] + k, K - k, mask);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * ldx + k);
      for (int n = 0; n < kRows; ++n) acc[r][n] = _mm512_fmadd_ps(wv[n], xv, acc[r][n]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

template <int R, typename T>
TPSERVE_AVX512 inline void tile_rows512(const T* const w[kRows], int64_t rows, int64_t n0, int64_t m, int64_t K,
                                        int64_t N, const float* x, const float* scale, const float* bias, float* y,
                                        const T* const* next, int phase, int groups) {
  __m128 out[R];
  tile512<R, T>(w, x + m * K, K, K, out, next, phase, groups);
  const __mmask8 mask = static_cast<__mmask8>((1u << rows) - 1);
  const __m128 s = scale ? _mm_maskz_loadu_ps(mask, scale + n0) : _mm_set1_ps(1.0f);
  const __m128 b = bias ? _mm_maskz_loadu_ps(mask, bias + n0) : _mm_setzero_ps();
  for (int r = 0; r < R; ++r) {
    _mm_mask_storeu_ps(y + (m + r) * N + n0, mask, _mm_add_ps(_mm_mul_ps(out[r], s), b));
  }
}

// `row(n, buffer)`: W's row n as a `const T*` (T float32, or a 16-bit float read as it is); `prefetch`: W
// itself where its rows are read in place (the next tile's lines are prefetched), else nullptr.
template <typename T, typename RowFn>
TPSERVE_AVX512 void run_rows512(int64_t n_begin, int64_t n_end, int64_t M, int64_t K, int64_t N, const float* x,
                                const float* scale, const float* bias, float* y, RowFn row, const T* prefetch) {
  std::vector<float> buffer(static_cast<size_t>(kRows * K));
  for (int64_t n0 = n_begin; n0 < n_end; n0 += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, n_end - n0);
    const T* w[kRows];
    for (int r = 0; r < kRows; ++r) w[r] = row(n0 + std::min<int64_t>(r, rows - 1), buffer.data() + r * K);
    // The next tile's rows (float32 weights only: int8 rows are widened from elsewhere), prefetched
    // during the first group of x rows so that memory streams while the FMAs run.
    const T* next_rows[kRows];
    const T* const* next = nullptr;
    if (prefetch && n0 + kRows < n_end) {
      for (int r = 0; r < kRows; ++r) next_rows[r] = prefetch + std::min<int64_t>(n0 + kRows + r, n_end - 1) * K;
      next = next_rows;
    }
    const int groups = static_cast<int>((M + 5) / 6);
    int64_t m = 0;
    int g = 0;
    for (; m + 6 <= M; m += 6, ++g) tile_rows512<6, T>(w, rows, n0, m, K, N, x, scale, bias, y, next, g, groups);
    switch (M - m) {
      case 5: tile_rows512<5, T>(w, rows, n0, m, K, N, x, scale, bias, y, next, g, groups); break;
      case 4: tile_rows512<4, T>(w, rows, n0, m, K, N, x, scale, bias, y, next, g, groups); break;
      case 3: tile_rows512<3, T>(w, rows, n0, m, K, N, x, scale, bias, y, next, g, groups); break;
      case 2: tile_rows512<2, T>(w, rows, n0, m, K, N, x, scale, bias, y, next, g, groups); break;
      case 1: tile_rows512<1, T>(w, rows, n0, m, K, N, x, scale, bias, y, next, g, groups); break;
      default: break;
    }
  }
}

// Up to kSeqMaxRows rows of x (a decode step of a few sequences), float32 or int8 weights: each thread's
// share of W is cut into S contiguous parts, read side by side, one row of each per pass, so a
// thread keeps S sequential streams in flight (each with a software prefetch kSeqAhead floats
// ahead). A stream is the access pattern the hardware prefetchers follow best; the 4-row tiles above
// read 4 rows 2-6 KB apart in step, which they track less well (on one Zen 5 core the 95M model's
// projections took 0.81x the tiles' time at M = 1 with one stream per thread). Why several streams
// rather than one: where W comes from DRAM rather than the last-level cache, one stream per core
// leaves the memory system idle between its misses. On the 2-core Xeon host (480 MB L3 shared with
// other tenants), the 95M model's 30 layers of projections, 2 threads, against one stream per thread
// and the tiles from 5 rows on, in the same run (benchmarks/README.md, "Streams per thread"): 0.67x
// the time at M = 1, 0.87x at 2, 0.58x at 4, 0.94x at 5, 0.92x at 6, 0.67x at 7 and 0.66x at 8, at
// about torch.sum's rate over the same bytes up to M = 4. From 9 rows on the product is FMA-bound and
// the tiles are as fast (0.94-1.04x at 10-16 rows). One accumulator per (stream, row of x): S * R
// independent FMA chains, which with the R x vectors and the weight vector must fit the 32 zmm
// registers: S = 4 up to 4 rows of x (16 + 4 + 1), 2 up to 8 (16 + 8 + 1). Each dot product is
// reduced once, at the end of its row.
constexpr int64_t kSeqAhead = 1024;  // floats: 4 KB ahead of the line being read, in each stream
constexpr int64_t kSeqMaxRows = 8;  // rows of x up to which the streamed GEMV is used (AVX-512)
// Streams of W rows per thread for R rows of x (the register budget above).
constexpr int seq_streams(int R) { return R <= 4 ? 4 : 2; }

// y[r * N + n] = (scale[n] *) x[r] . W[n] (+ bias[n]) for the S rows n = rows[s] and R rows of x, one
// pass over the rows side by side. W is float32, or int8 with one float32 scale per row (applied to
// the dot product, as in the tiles). Prefetches run 4 KB ahead in each stream whatever the type.
template <int R, int S, typename T>
TPSERVE_AVX512 inline void seq_dots512(const int64_t rows[S], int64_t K, int64_t N, const float* x, const float* scale,
                                       const float* bias, float* y, const T* w) {
  constexpr int64_t ahead = kSeqAhead * 4 / static_cast<int64_t>(sizeof(T));  // elements in 4 KB
  constexpr int64_t line = 64 / static_cast<int64_t>(sizeof(T));  // elements in a 64-byte line
  const T* wr[S];
  __m512 acc[S][R];
  for (int s = 0; s < S; ++s) {
    wr[s] = w + rows[s] * K;
    for (int r = 0; r < R; ++r) acc[s][r] = _mm512_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x + r * K + k);
    for (int s = 0; s < S; ++s) {
      if (sizeof(T) == 4 || k % line == 0) {  // one per 64-byte line (every step for float32)
        _mm_prefetch(reinterpret_cast<const char*>(wr[s] + k + ahead), _MM_HINT_T0);
      }
      const __m512 wv = load16(wr[s] + k);
      for (int r = 0; r < R; ++r) acc[s][r] = _mm512_fmadd_ps(wv, xv[r], acc[s][r]);
    }
  }
  for (int s = 0; s < S; ++s) {
    const int64_t n = rows[s];
    for (int r = 0; r < R; ++r) {
      float sum = _mm512_reduce_add_ps(acc[s][r]);
      for (int64_t t = k; t < K; ++t) sum += static_cast<float>(wr[s][t]) * x[r * K + t];  // K % 16 tail
      y[r * N + n] = (scale ? scale[n] * sum : sum) + (bias ? bias[n] : 0.0f);
    }
  }
}

template <int R, typename T>
TPSERVE_AVX512 void run_seq512(int64_t n_begin, int64_t n_end, int64_t K, int64_t N, const float* x,
                               const float* scale, const float* bias, float* y, const T* w) {
  constexpr int S = seq_streams(R);
  const int64_t part = (n_end - n_begin) / S;  // rows per stream; the remainder streams alone after
  for (int64_t i = 0; i < part; ++i) {
    int64_t rows[S];
    for (int s = 0; s < S; ++s) rows[s] = n_begin + s * part + i;
    seq_dots512<R, S>(rows, K, N, x, scale, bias, y, w);
  }
  for (int64_t n = n_begin + S * part; n < n_end; ++n) {
    const int64_t rows[1] = {n};
    seq_dots512<R, 1>(rows, K, N, x, scale, bias, y, w);
  }
}

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  return has;
}

// Cleared by use_avx512(False): tests and A/B measurements run the AVX2 path on AVX-512 machines.
std::atomic<bool> allow_avx512{true};

// Enable (the default) or disable the AVX-512 path; returns whether it is now in use.
bool use_avx512(bool enabled) {
  allow_avx512.store(enabled);
  return enabled && cpu_has_avx512();
}

// ---- AVX2 + FMA ------------------------------------------------------------------------------

// R rows of y from row m on, for the tile of W rows [n0, n0 + rows).
template <int R>
inline void tile_rows(const float* const w[kRows], int64_t rows, int64_t n0, int64_t m, int64_t K, int64_t N,
                      const float* x, const float* scale, const float* bias, float* y, const float* const* next) {
  float out[R][kRows];
  tile<R>(w, x + m * K, K, K, out, next);
  for (int r = 0; r < R; ++r) {
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t n = n0 + i;
      y[(m + r) * N + n] = out[r][i] * (scale ? scale[n] : 1.0f) + (bias ? bias[n] : 0.0f);
    }
  }
}

// 8 weights from k on as float32 (AVX2 + F16C): loaded or widened as load16 above.
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
inline __m256 load8(const c10::BFloat16* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* w) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))); }

// int8 -> float32, 8 at a time (vpmovsxbd + vcvtdq2ps).
inline void widen_row(const int8_t* q, int64_t K, float* dst) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k));
    _mm256_storeu_ps(dst + k, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
  }
  for (; k < K; ++k) dst[k] = static_cast<float>(q[k]);
}

// bfloat16 / float16 -> float32, exactly, 8 at a time (load8).
template <typename T>
inline void widen_row16(const T* w, int64_t K, float* dst) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, load8(w + k));
  for (; k < K; ++k) dst[k] = static_cast<float>(w[k]);
}

// y rows [0, M) x columns [n_begin, n_end), tile by tile. `row(n, buffer)` returns a pointer to
// W's row n as float32 (the row itself, or its widened copy in `buffer`).
template <typename RowFn>
void run_rows(int64_t n_begin, int64_t n_end, int64_t M, int64_t K, int64_t N, const float* x,
              const float* scale, const float* bias, float* y, RowFn row, const float* prefetch) {
  std::vector<float> buffer(static_cast<size_t>(kRows * K));
  for (int64_t n0 = n_begin; n0 < n_end; n0 += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, n_end - n0);
    const float* w[kRows];
    for (int r = 0; r < kRows; ++r) {
      // A short last tile repeats its last row; the extra results are not written.
      w[r] = row(n0 + std::min<int64_t>(r, rows - 1), buffer.data() + r * K);
    }
    const float* next_rows[kRows];
    const float* const* next = nullptr;
    if (prefetch && n0 + kRows < n_end) {  // as in run_rows512
      for (int r = 0; r < kRows; ++r) next_rows[r] = prefetch + std::min<int64_t>(n0 + kRows + r, n_end - 1) * K;
      next = next_rows;
    }
    // W's tile is read from memory by the first group of x rows and from L1 by the others.
    int64_t m = 0;
    for (; m + 3 <= M; m += 3, next = nullptr) tile_rows<3>(w, rows, n0, m, K, N, x, scale, bias, y, next);
    if (M - m == 2) tile_rows<2>(w, rows, n0, m, K, N, x, scale, bias, y, next);
    if (M - m == 1) tile_rows<1>(w, rows, n0, m, K, N, x, scale, bias, y, next);
  }
}

// The streamed GEMV of run_seq512 in 8-float vectors, for CPUs without AVX-512: up to kSeqMaxRows2 rows
// of x, S streams of W rows per thread within the 16 ymm registers (S * R accumulators + R x vectors +
// 1 weight vector: 4 streams up to 2 rows of x, 11 registers; 2 up to 4, 13). The K % 8 tail is scalar.
// Against the AVX2 tiles, on the 2-core Xeon host with use_avx512(False), the 95M model's projections:
// 0.90x the time at M = 1, 0.92x at 2 and 3, 0.86x at 4 (benchmarks/README.md, "Streams per thread").
// From 5 rows on the tiles' 3-row groups stay (as many rows as registers allow, and FMA-bound sooner).
// Both streamed GEMVs take int8 weights too (load16/load8 widen them as they arrive; against the
// tiles, which widen a row at a time into an L1 buffer: 0.43-0.50x the time at 1-4 rows of x,
// 0.52x at 5 and 0.60x at 8 on AVX-512; results/decode_linears_int8_streams.json).
constexpr int64_t kSeqMaxRows2 = 4;
constexpr int seq_streams2(int R) { return R <= 2 ? 4 : 2; }


template <int R, int S, typename T>
inline void seq_dots256(const int64_t rows[S], int64_t K, int64_t N, const float* x, const float* scale,
                        const float* bias, float* y, const T* w) {
  constexpr int64_t ahead = kSeqAhead * 4 / static_cast<int64_t>(sizeof(T));
  constexpr int64_t line = 64 / static_cast<int64_t>(sizeof(T));
  const T* wr[S];
  __m256 acc[S][R];
  for (int s = 0; s < S; ++s) {
    wr[s] = w + rows[s] * K;
    for (int r = 0; r < R; ++r) acc[s][r] = _mm256_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * K + k);
    for (int s = 0; s < S; ++s) {
      if (k % line == 0) _mm_prefetch(reinterpret_cast<const char*>(wr[s] + k + ahead), _MM_HINT_T0);
      const __m256 wv = load8(wr[s] + k);
      for (int r = 0; r < R; ++r) acc[s][r] = _mm256_fmadd_ps(wv, xv[r], acc[s][r]);
    }
  }
  for (int s = 0; s < S; ++s) {
    const int64_t n = rows[s];
    for (int r = 0; r < R; ++r) {
      float sum = hsum(acc[s][r]);
      for (int64_t t = k; t < K; ++t) sum += static_cast<float>(wr[s][t]) * x[r * K + t];  // K % 8 tail
      y[r * N + n] = (scale ? scale[n] * sum : sum) + (bias ? bias[n] : 0.0f);
    }
  }
}

template <int R, typename T>
void run_seq256(int64_t n_begin, int64_t n_end, int64_t K, int64_t N, const float* x, const float* scale,
                const float* bias, float* y, const T* w) {
  constexpr int S = seq_streams2(R);
  const int64_t part = (n_end - n_begin) / S;  // rows per stream; the remainder streams alone after
  for (int64_t i = 0; i < part; ++i) {
    int64_t rows[S];
    for (int s = 0; s < S; ++s) rows[s] = n_begin + s * part + i;
    seq_dots256<R, S>(rows, K, N, x, scale, bias, y, w);
  }
  for (int64_t n = n_begin + S * part; n < n_end; ++n) {
    const int64_t rows[1] = {n};
    seq_dots256<R, 1>(rows, K, N, x, scale, bias, y, w);
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

// The streamed GEMV for R = M rows of x, W's rows [n0, n1).
template <typename T>
void seq512_rows(int64_t M, int64_t n0, int64_t n1, int64_t K, int64_t N, const float* x, const float* scale,
                 const float* bias, float* y, const T* w) {
  switch (M) {
    case 1: run_seq512<1>(n0, n1, K, N, x, scale, bias, y, w); break;
    case 2: run_seq512<2>(n0, n1, K, N, x, scale, bias, y, w); break;
    case 3: run_seq512<3>(n0, n1, K, N, x, scale, bias, y, w); break;
    case 4: run_seq512<4>(n0, n1, K, N, x, scale, bias, y, w); break;
    case 5: run_seq512<5>(n0, n1, K, N, x, scale, bias, y, w); break;
    case 6: run_seq512<6>(n0, n1, K, N, x, scale, bias, y, w); break;
    case 7: run_seq512<7>(n0, n1, K, N, x, scale, bias, y, w); break;
    default: run_seq512<8>(n0, n1, K, N, x, scale, bias, y, w); break;
  }
}

// Rows of x per block for a prefill-sized product (see linear): 96 rows of K = 1536 are 576 KB.
constexpr int64_t kMBlock = 96;

// Whole tiles per task, and enough of them that each thread streams a long run of W.
int64_t grain_tiles(int64_t N) { return std::max<int64_t>(1, (N / kRows) / (4 * at::get_num_threads())); }

// y (M, N) = x @ W^T [* scale] [+ bias], W's rows split between the threads by whole tiles;
// `row(n, buffer)` gives W's row n as float32 (see run_rows). `streamed`: W itself (float32, int8 with
// `scale`, or a 16-bit float), for the streamed GEMV of up to kSeqMaxRows (AVX-512) or kSeqMaxRows2 (AVX2)
// rows of x; nullptr: the tiles at every row count. `row512` / `prefetch512`: the AVX-512 tiles' rows and
// prefetch base, of element type W512 (float32, or a 16-bit float the tiles widen in registers).
template <typename T, typename RowFn, typename W512, typename RowFn512>
at::Tensor linear(const at::Tensor& x, int64_t N, const float* scale, const c10::optional<at::Tensor>& bias,
                  RowFn row, const float* prefetch, const T* streamed, RowFn512 row512, const W512* prefetch512) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const bool avx512 = allow_avx512.load(std::memory_order_relaxed) && cpu_has_avx512();
  const bool seq = streamed != nullptr && M <= (avx512 ? kSeqMaxRows : kSeqMaxRows2);
  // Rows of x per pass over a thread's share of W: a prefill-sized x would not stay in L2 while
  // each W tile meets all its rows, so it is cut into blocks that do (kMBlock * K * 4 bytes).
  const int64_t m_block = M <= 2 * kMBlock ? M : kMBlock;
  at::parallel_for(0, (N + kRows - 1) / kRows, grain_tiles(N), [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * kRows, n1 = std::min(N, t1 * kRows);
    if (seq && avx512) {
      seq512_rows(M, n0, n1, K, N, xp, scale, bp, yp, streamed);
      return;
    }
    if (seq) {
      switch (M) {
        case 1: run_seq256<1>(n0, n1, K, N, xp, scale, bp, yp, streamed); break;
        case 2: run_seq256<2>(n0, n1, K, N, xp, scale, bp, yp, streamed); break;
        case 3: run_seq256<3>(n0, n1, K, N, xp, scale, bp, yp, streamed); break;
        default: run_seq256<4>(n0, n1, K, N, xp, scale, bp, yp, streamed); break;
      }
      return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += m_block) {
      const int64_t rows = std::min(m_block, M - m0);
      if (avx512) {
        run_rows512(n0, n1, rows, K, N, xp + m0 * K, scale, bp, yp + m0 * N, row512, prefetch512);
      } else {
        run_rows(n0, n1, rows, K, N, xp + m0 * K, scale, bp, yp + m0 * N, row, prefetch);
      }
    }
  });
  return y;
}

// Float32 or int8 W: the AVX-512 tiles read the AVX2 tiles' float32 rows.
template <typename T, typename RowFn>
at::Tensor linear(const at::Tensor& x, int64_t N, const float* scale, const c10::optional<at::Tensor>& bias,
                  RowFn row, const float* prefetch, const T* streamed) {
  return linear(x, N, scale, bias, row, prefetch, streamed, row, prefetch);
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_inputs(x, w, bias);
  TORCH_CHECK(w.scalar_type() == at::kFloat, "tpserve linear_f32: weight must be float32");
  const float* wp = w.data_ptr<float>();
  const int64_t K = w.size(1);
  return linear(x, w.size(0), nullptr, bias, [=](int64_t n, float*) { return wp + n * K; }, wp, wp);
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
  }, nullptr, qp);
}

// W bfloat16 or float16 (N, K), widened exactly as it is read: linear_f32's bits on W's float32 copy, at
// half its bytes (a checkpoint's 16-bit LM head served with float32 activations: worker/layers/embedding.py).
template <typename T>
at::Tensor linear_w16_as(const at::Tensor& x, const T* wp, int64_t N, int64_t K,
                         const c10::optional<at::Tensor>& bias) {
  const auto widened = [=](int64_t n, float* buf) {  // the AVX2 tiles' rows: widened into L1
    widen_row16(wp + n * K, K, buf);
    return static_cast<const float*>(buf);
  };
  const auto in_place = [=](int64_t n, float*) { return wp + n * K; };  // the AVX-512 tiles widen in registers
  return linear(x, N, nullptr, bias, widened, nullptr, wp, in_place, wp);
}

at::Tensor linear_w16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_inputs(x, w, bias);
  if (w.scalar_type() == at::kBFloat16) return linear_w16_as(x, w.data_ptr<c10::BFloat16>(), w.size(0), w.size(1), bias);
  TORCH_CHECK(w.scalar_type() == at::kHalf, "tpserve linear_w16: weight must be bfloat16 or float16, got ",
              w.scalar_type());
  return linear_w16_as(x, w.data_ptr<c10::Half>(), w.size(0), w.size(1), bias);
}

}  // namespace

namespace tpserve {

bool streamed_gemv_takes(int64_t M) {
  return M >= 1 && M <= kSeqMaxRows && allow_avx512.load(std::memory_order_relaxed) && cpu_has_avx512();
}

void streamed_gemv_rows(const float* x, int64_t M, int64_t K, int64_t N, const float* w_f32, const int8_t* w_i8,
                        const float* scale, const float* bias, float* y, int64_t n0, int64_t n1) {
  if (n0 >= n1) return;
  if (w_i8 != nullptr) {
    seq512_rows(M, n0, n1, K, N, x, scale, bias, y, w_i8);
  } else {
    seq512_rows(M, n0, n1, K, N, x, scale, bias, y, w_f32);
  }
}

at::Tensor tiles_from_rows(const at::Tensor& x, int64_t N, const c10::optional<at::Tensor>& bias,
                           const std::function<const float*(int64_t, float*)>& row) {
  return linear(x, N, nullptr, bias, row, nullptr, static_cast<const float*>(nullptr));
}

void streamed_gemv_rows16(const float* x, int64_t M, int64_t K, int64_t N, const void* w, bool bfloat16,
                          const float* bias, float* y, int64_t n0, int64_t n1) {
  if (n0 >= n1) return;
  if (bfloat16) {
    seq512_rows(M, n0, n1, K, N, x, nullptr, bias, y, static_cast<const c10::BFloat16*>(w));
  } else {
    seq512_rows(M, n0, n1, K, N, x, nullptr, bias, y, static_cast<const c10::Half*>(w));
  }
}

}  // namespace tpserve

TORCH_LIBRARY(tpserve_cpu, m) {
  m.def("linear_f32(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor qweight, Tensor scale, Tensor? bias) -> Tensor");
  m.def("linear_w16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("use_avx512(bool enabled) -> bool", &use_avx512);
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) {
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_int8", &linear_int8);
  m.impl("linear_w16", &linear_w16);
}
