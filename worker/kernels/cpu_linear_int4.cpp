// Weight-only int4 linear layers on AVX2 and AVX-512 CPUs: y (M, N) = x (M, K) @ W (N, K)^T [+ bias (N,)],
// W stored as packed 4-bit codes with a float32 scale and offset per group of G input columns.
//
// Why: a decode step streams every weight matrix from memory once, so its time is the bytes read;
// 4-bit codes with one (scale, offset) pair of float32 per group of 128 are 4.5 bits a weight
// against int8's 8.25, and the codes are widened to float32 in registers, never written back.
//
// Layout (worker/layers/int4_weights.py packs it; the Python fallback reads the same):
//   qweight (N, K / 2) uint8: the codes q in [0, 15] of each row, in blocks of 32 columns; block b
//     (columns 32b .. 32b + 31) is bytes 16b .. 16b + 15, byte j holding column 32b + j in its low
//     nibble and column 32b + 16 + j in its high one. So one 16-byte load and two masks give 32
//     codes as two runs of 16 consecutive columns (one zmm each, or four ymm), no shuffles.
//   scale_offset (N, K / G, 2) float32: per row and group, (s, o) with w = s * q + o (o = -s * z for
//     a zero point z: symmetric RTN stores z = 8). G is a multiple of 32 dividing K.
//
// The paths, picked at run time in this order: a prefill-sized product (more than kChunkedMaxRows rows of x)
// dequantizes W once to float32 and multiplies by at::matmul (its cost is then the multiplication); the tile layout
// (a 4-dimensional scale_offset, repacked at load on AMX-INT8 CPUs: cpu_linear_int4_tiles.cpp) at every row count;
// AMX-INT8 over this layout from 2 rows (cpu_linear_int4_amx.cpp); without AMX, on AVX-512, from kRowTilesFrom (9)
// rows each row of W dequantized once into L1 and multiplied by linear_f32's tiles (tpserve::tiles_from_rows);
// AVX-512 VNNI for up to 4 rows of x and groups of a multiple of 128 columns (the codes stay bytes and meet x, cut
// into three int8 planes, in vpdpbusd: dots_vnni); the float paths, AVX-512 (F, VL, BW; each code widened to
// float32 in registers and multiplied in float32: 5-8 rows there) and AVX2.
//
// The float paths: sum_g [ s_g * sum_{k in g} q_k x_k + o_g * xsum_g ], xsum_g = sum_{k in g} x_k once per
// call; q_k x_k summed in a vector per (row, row of x), scaled by s_g once a group (not an FMA a weight).
// They are group_dots.h's templates (shared with cpu_linear_w8.cpp) over this layout's Codes below; x's
// planes for the VNNI path and the AMX paths are cut by int4_planes.h.
//
// Rows of x on the VNNI and float paths: up to kMaxRowsVnni / kMaxRows512 (AVX-512) or kMaxRows256 (AVX2) at
// once, each thread owning a range of W's rows and reading S of them side by side (several sequential streams in
// flight, as the int8 kernel's streamed GEMV in cpu_linear.cpp; S by the register budget). More rows of x are
// taken in chunks of that many (W re-read per chunk, 4 bits a weight each time) up to kChunkedMaxRows.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_linear.h"
#include "cpu_linear_int4.h"
#include "group_dots.h"
#include "int4_planes.h"
#include "row_streams.h"

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <vector>

namespace tpserve_int4 {

constexpr int64_t kBlock = 32;           // columns per 16-byte block of codes
constexpr int64_t kChunkedMaxRows = 64;  // beyond: dequantize W once and at::matmul
constexpr int64_t kAhead = 2048;         // bytes prefetched ahead in each stream (4096 columns)

using Args = tpserve::GroupArgs;

// The codes for group_dots.h' float paths: a block (32 columns, 16 bytes) a step, one 16-byte load and two
// masks giving two runs of 16 consecutive columns (one zmm each, or four ymm), no shuffles.
struct Codes {
  static constexpr int64_t kCodesPerByte = 2;
  static constexpr int64_t kStep = kBlock;
  static constexpr int64_t kMaxRows512 = 8;  // rows of x per pass, AVX-512
  static constexpr int64_t kMaxRows256 = 4;  // rows of x per pass, AVX2

  TPSERVE_GROUP_AVX512 static inline void widen512(const uint8_t* p, __m512 w[2]) {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low)));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low)));
  }
  static inline void widen256(const uint8_t* p, __m256 w[4]) {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i lo = _mm_and_si128(bytes, low);                      // columns k .. k + 15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);  // columns k + 16 .. k + 31
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
};

// ---- AVX-512 VNNI: the codes times x carried as 24-bit fixed point, in integer dot products ----------
// The codes stay bytes and meet x in vpdpbusd (64 byte products an instruction; widening to float costs 3
// instructions per 16 weights). x is cut per chunk of 128 columns into three int8 planes, x ~= u (65536 xh
// + 256 xm + xl), u = max|x_chunk| / (127 * 65536): |x - approx| <= max|x_chunk| / 1.7e7 (docs/design/
// kernels.md, "int4": why three planes). Per chunk and row of x: sum q (256 xh + xm) (|.| < 2^26) and sum
// q xl in int32, combined in float32, scaled by u and the group's scale into the row's total. A 64-byte
// load of codes is 4 blocks (low nibbles: columns 32b + j, high: 32b + 16 + j), so a chunk's planes are
// [xh low | xh high | xm low | xm high | xl low | xl high], 64 bytes each. Groups: whole chunks (G % 128 == 0).
#define TPSERVE_INT4_VNNI __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni")))
constexpr int64_t kChunk = 128;       // columns per plane chunk (one 64-byte load of codes)
constexpr int64_t kMaxRowsVnni = 4;   // rows of x per pass
constexpr int streams_vnni(int R) { return R == 1 ? 4 : (R <= 3 ? 2 : 1); }

constexpr int64_t kPlaneBytes = 384;  // per chunk: six 64-byte planes

struct Planes {
  const int8_t* x;   // (R, K / 128, 384): per row and chunk, the six 64-byte planes
  const float* unit; // (R, K / 128): u of each chunk
};

template <int R, int S>
TPSERVE_INT4_VNNI inline void dots_vnni(const int64_t rows[S], const Args& a, const Planes& pl) {
  const int64_t chunks = a.K / kChunk, per_group = a.G / kChunk;
  const uint8_t* wr[S];
  const float* sr[S];
  __m512 total[S][R];
  float offset[S][R];
  for (int s = 0; s < S; ++s) {
    wr[s] = a.w + rows[s] * (a.K / 2);
    sr[s] = a.so + rows[s] * a.groups * 2;
    for (int r = 0; r < R; ++r) {
      total[s][r] = _mm512_setzero_ps();
      offset[s][r] = 0.0f;
    }
  }
  for (int64_t g = 0; g < a.groups; ++g) {  // the offsets' terms, o_g * xsum_g
    for (int s = 0; s < S; ++s) {
      for (int r = 0; r < R; ++r) offset[s][r] += sr[s][2 * g + 1] * a.xsum[r * a.groups + g];
    }
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512 radix = _mm512_set1_ps(256.0f);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t g = c / per_group;
    for (int s = 0; s < S; ++s) {
      const uint8_t* p = wr[s] + c * 64;
      _mm_prefetch(reinterpret_cast<const char*>(p + kAhead), _MM_HINT_T0);
      const __m512i bytes = _mm512_loadu_si512(p);
      const __m512i lo = _mm512_and_si512(bytes, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
      const float scale = sr[s][2 * g];
      for (int r = 0; r < R; ++r) {
        const int8_t* xp = pl.x + (r * chunks + c) * kPlaneBytes;
        __m512i ah = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xp));
        ah = _mm512_dpbusd_epi32(ah, hi, _mm512_loadu_si512(xp + 64));
        __m512i am = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xp + 128));
        am = _mm512_dpbusd_epi32(am, hi, _mm512_loadu_si512(xp + 192));
        __m512i al = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xp + 256));
        al = _mm512_dpbusd_epi32(al, hi, _mm512_loadu_si512(xp + 320));
        // sum q x / u = 256 (256 ah + am) + al, then times u and the group's scale into the row's total.
        const __m512 upper = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ah, 8), am));
        const __m512 sum = _mm512_fmadd_ps(upper, radix, _mm512_cvtepi32_ps(al));
        total[s][r] = _mm512_fmadd_ps(sum, _mm512_set1_ps(pl.unit[r * chunks + c] * scale), total[s][r]);
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

template <int R>
void run_vnni(int64_t n_begin, int64_t n_end, const Args& a, const Planes& pl) {
  tpserve::stream_rows<streams_vnni(R)>(n_begin, n_end, [&](const int64_t* rows, auto streams) {
    dots_vnni<R, decltype(streams)::value>(rows, a, pl);
  });
}

// The planes and units of rows [0, M) of x (K % 128 == 0), laid out as dots_vnni reads them, 16 columns
// at a time (a scalar loop took ~10 ns a column: 0.9 ms of the 95M model's 3 ms step). x / u is rounded
// to an integer v (|v| <= 127 * 65536 < 2^24, exact in float32) and split into balanced base-256
// digits, each in [-128, 127]: v = 65536 xh + 256 xm + xl exactly.
TPSERVE_INT4_VNNI void make_planes(const float* x, int64_t M, int64_t K, std::vector<int8_t>& planes,
                                   std::vector<float>& units) {
  const int64_t chunks = K / kChunk;
  planes.assign(static_cast<size_t>(M * chunks * kPlaneBytes), 0);
  units.assign(static_cast<size_t>(M * chunks), 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < chunks; ++c) {
      const float* xc = x + m * K + c * kChunk;
      const float top = chunk_max_abs(xc);
      if (top == 0.0f) continue;  // planes and unit stay zero
      const float unit = top / (127.0f * 65536.0f);
      units[m * chunks + c] = unit;
      const __m512 u = _mm512_set1_ps(unit);
      int8_t* out = planes.data() + (m * chunks + c) * kPlaneBytes;
      for (int64_t i = 0; i < kChunk / 16; ++i) {  // columns 16i .. 16i + 15: one half of block i / 2
        __m512i xh, xm, xl;
        plane_digits(xc + 16 * i, u, xh, xm, xl);
        int8_t* dst = out + (i / 2) * 16 + (i % 2) * 64;  // low nibbles' plane, then high's
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(xh));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 128), _mm512_cvtepi32_epi8(xm));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 256), _mm512_cvtepi32_epi8(xl));
      }
    }
  }
}

// Row n of W as float32, w = s * q + o with one rounding (an FMA), 32 columns (one block of codes) at a time: the
// row the dequantized tiles below multiply (G a multiple of 32, so a block lies in one group).
TPSERVE_GROUP_AVX512 void dequantize_row512(const uint8_t* q, const float* so, int64_t K, int64_t G, float* out) {
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    const float* g = so + (k0 / G) * 2;
    const __m512 s = _mm512_set1_ps(g[0]), o = _mm512_set1_ps(g[1]);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k0 / 2));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low)));
    _mm512_storeu_ps(out + k0, _mm512_fmadd_ps(s, lo, o));
    _mm512_storeu_ps(out + k0 + 16, _mm512_fmadd_ps(s, hi, o));
  }
}

// Rows of x from which the dequantized rows' tiles run: 1.13-1.85x the float path at 9-64 rows (benchmarks/
// int4_row_tiles.py); at 8 an unrecorded run found them no faster (32.2 against 32.3 ms).
constexpr int64_t kRowTilesFrom = 9;
std::atomic<bool> allow_row_tiles{true};  // use_int4_row_tiles(False): the float path (tests, A/B runs)
bool use_int4_row_tiles(bool enabled) {
  allow_row_tiles.store(enabled);
  return enabled;
}

using tpserve::cpu_has_avx512bw;
std::atomic<bool> allow_wide{true};  // use_avx512_int4(False): the AVX2 path (tests, A/B runs)
bool use_avx512_int4(bool enabled) {
  allow_wide.store(enabled);
  return enabled && cpu_has_avx512bw();
}

bool use_wide() { return allow_wide.load(std::memory_order_relaxed) && cpu_has_avx512bw(); }
bool cpu_has_vnni() {
  static const bool has = cpu_has_avx512bw() && __builtin_cpu_supports("avx512vnni");
  return has;
}
std::atomic<bool> allow_vnni{true};  // use_vnni_int4(False): the float AVX-512 path (tests, A/B runs)
bool use_vnni_int4(bool enabled) {
  allow_vnni.store(enabled);
  return enabled && cpu_has_vnni();
}
std::atomic<bool> allow_amx{true};  // use_amx_int4(False): the VNNI and float paths (tests, A/B runs)
bool use_amx_int4(bool enabled) {
  allow_amx.store(enabled);
  return enabled && tpserve_int4_amx::amx_available();
}

bool amx_allowed() { return allow_amx.load(std::memory_order_relaxed); }

bool vnni_rows_take(int64_t M, int64_t K, int64_t N, int64_t G) {
  // linear_int4's choice at M rows of x over the row-major layout: not AMX (from 2 rows), the VNNI path.
  const bool amx = M >= 2 && allow_amx.load(std::memory_order_relaxed) && use_wide() && N % 16 == 0 &&
                   G % kChunk == 0 && tpserve_int4_amx::amx_available();
  return !amx && M >= 1 && M <= kMaxRowsVnni && use_wide() && allow_vnni.load(std::memory_order_relaxed) &&
         cpu_has_vnni() && G % kChunk == 0 && K % kChunk == 0;
}

void vnni_prepare(const float* x, int64_t M, int64_t K, int64_t G, std::vector<int8_t>& planes,
                  std::vector<float>& units, std::vector<float>& xsum) {
  xsum.resize(static_cast<size_t>(M * (K / G)));
  group_sums512(x, M, K, G, xsum.data());
  make_planes(x, M, K, planes, units);
}

void vnni_rows(int64_t M, int64_t n0, int64_t n1, int64_t K, int64_t N, int64_t G, const uint8_t* qweight,
               const float* scale_offset, const int8_t* planes, const float* units, const float* xsum,
               const float* bias, float* y) {
  if (n0 >= n1) return;
  const Args a{K, N, G, K / G, nullptr, xsum, qweight, scale_offset, bias, y};
  const Planes pl{planes, units};
  switch (M) {
    case 1: run_vnni<1>(n0, n1, a, pl); break;
    case 2: run_vnni<2>(n0, n1, a, pl); break;
    case 3: run_vnni<3>(n0, n1, a, pl); break;
    default: run_vnni<4>(n0, n1, a, pl); break;
  }
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale_offset,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "tpserve linear_int4: x must be a contiguous float32 (M, K) CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "tpserve linear_int4: bias must be a contiguous float32 (N,) tensor");
  }
  if (scale_offset.dim() == 4) {  // the tile layout (cpu_linear_int4_tiles.cpp), repacked at load
    return tpserve_int4_tiles::linear_op(x, qweight, scale_offset, bias);
  }
  check(qweight, scale_offset, K);
  if (M > kChunkedMaxRows) {  // prefill-sized: compute-bound, so dequantize once and multiply
    return tpserve::dequantized_matmul(x, dequantize_int4(qweight, scale_offset), bias);
  }
  const int64_t groups = scale_offset.size(1), G = K / groups;
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  // AMX from 2 rows of x: at one row the VNNI path's 4 sequential streams of W read the last-level cache
  // faster than a tile's 16 interleaved rows (kernels.md, "int4": AMX).
  if (M >= 2 && allow_amx.load(std::memory_order_relaxed) && use_wide() && N % 16 == 0 && G % kChunk == 0 &&
      tpserve_int4_amx::amx_available()) {
    tpserve_int4_amx::linear(xp, M, K, N, G, qweight.data_ptr<uint8_t>(), scale_offset.data_ptr<float>(),
                             bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>());
    return y;
  }
  const bool wide = use_wide();
  // From kRowTilesFrom rows of x on AVX-512 (a CPU without AMX-INT8, whose paths take those above): each row of W
  // dequantized once into L1 and multiplied by linear_f32's tiles, 4 rows of W against 6 of x. The float path
  // below re-widens every code once per 8 rows of x and loads x once per row of W; the tiles share each load
  // (kernels.md, "int4": without AMX).
  if (wide && M >= kRowTilesFrom && allow_row_tiles.load(std::memory_order_relaxed)) {
    const uint8_t* qp = qweight.data_ptr<uint8_t>();
    const float* sp = scale_offset.data_ptr<float>();
    return tpserve::tiles_from_rows(x, N, bias, [=](int64_t n, float* buffer) {
      dequantize_row512(qp + n * (K / 2), sp + n * groups * 2, K, G, buffer);
      return static_cast<const float*>(buffer);
    });
  }
  // Per row of x and group: the sum of x over the group's columns (the offsets' factor).
  std::vector<float> xsum(static_cast<size_t>(M * groups));
  if (wide) {
    group_sums512(xp, M, K, G, xsum.data());
  } else {
    tpserve::group_sums(xp, M, K, G, xsum.data());
  }
  // VNNI up to kMaxRowsVnni rows: beyond (5-8 rows here; from 9 the tiles above), the float path's widening,
  // shared by up to 8 rows of x a pass, costs less per row than three dot products a plane (kernels.md, "int4").
  if (wide && M <= kMaxRowsVnni && allow_vnni.load(std::memory_order_relaxed) && cpu_has_vnni() &&
      G % kChunk == 0) {
    std::vector<int8_t> planes;
    std::vector<float> units;
    make_planes(xp, M, K, planes, units);
    const int64_t chunks = K / kChunk;
    const int64_t grain = std::max<int64_t>(1, N / (4 * at::get_num_threads()));
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsVnni) {
      const int64_t rows = std::min(kMaxRowsVnni, M - m0);
      const Args a{K, N, G, groups, xp + m0 * K, xsum.data() + m0 * groups, qweight.data_ptr<uint8_t>(),
                   scale_offset.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                   y.data_ptr<float>() + m0 * N};
      const Planes pl{planes.data() + m0 * chunks * kPlaneBytes, units.data() + m0 * chunks};
      at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        switch (rows) {
          case 1: run_vnni<1>(n0, n1, a, pl); break;
          case 2: run_vnni<2>(n0, n1, a, pl); break;
          case 3: run_vnni<3>(n0, n1, a, pl); break;
          default: run_vnni<4>(n0, n1, a, pl); break;
        }
      });
    }
    return y;
  }
  tpserve::group_linear<Codes>(xp, M, K, N, G, xsum.data(), qweight.data_ptr<uint8_t>(),
                               scale_offset.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                               y.data_ptr<float>(), wide);
  return y;
}

}  // namespace tpserve_int4

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("linear_int4(Tensor x, Tensor qweight, Tensor scale_offset, Tensor? bias) -> Tensor");
  m.def("dequantize_int4(Tensor qweight, Tensor scale_offset) -> Tensor");
  m.def("use_avx512_int4(bool enabled) -> bool", &tpserve_int4::use_avx512_int4);
  m.def("use_vnni_int4(bool enabled) -> bool", &tpserve_int4::use_vnni_int4);
  m.def("use_amx_int4(bool enabled) -> bool", &tpserve_int4::use_amx_int4);
  m.def("use_int4_row_tiles(bool enabled) -> bool", &tpserve_int4::use_int4_row_tiles);
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) {
  m.impl("linear_int4", &tpserve_int4::linear_int4);
  m.impl("dequantize_int4", &tpserve_int4::dequantize_int4);
}
