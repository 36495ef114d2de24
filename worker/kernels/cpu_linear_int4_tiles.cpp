// linear_int4 over the tile layout: W's codes repacked once at load into the byte order AMX's B operand reads,
// so that a decode step streams W in one sequential pass and its vector work is one nibble split per byte.
//
// Why (docs/design/kernels.md, "int4": the tile layout): at one row of x the AVX512-VNNI path spends about 11
// cycles per 128 weights on port 0 (six vpdpbusd for x's three planes, their combination, the nibble shift),
// as many as int8's widening, so int4 decoded at 1.0-1.16x int8's speed with half the bytes. The AMX path of
// cpu_linear_int4_amx.cpp moves the products to the tile unit but keeps the row-major codes: each tile reads
// 16 rows of W 64 bytes at a time (16 interleaved streams) and folds 16 rows of C one at a time.
// Here W is the B operand (16 rows of W side by side, 4 columns each), x's planes the A operand:
//   C (3R x 16 int32) += A (3R planes x 64 columns, int8) . B (64 columns x 16 rows of W, codes as u8)
// (tdpbsud). One C row holds one plane's dot products for 16 rows of W, so the per-chunk fold is 3 vector
// conversions per row of x for 16 rows of W, and y is stored 16 rows at a time (no horizontal sums).
//
// Layout (made by worker/layers/int4_matmul.py, pack_tiles; same bytes as the row-major layout):
//   qweight (N, K / 2) uint8, read as blocks (t, c) of 1,024 bytes, t = n / 16 (16 rows of W), c = k / 128 (one
//     chunk), in the order t * (K / 128) + c: W streams front to back. Within a block, 64-byte row r (0..15)
//     holds at byte 4 j + i (j: the row of W within the 16, i < 4) column 128 c + 4 r + i of row 16 t + j in
//     its low nibble and column 128 c + 64 + 4 r + i in its high one: the low nibbles of the 16 rows are
//     B's tile for the chunk's first 64 columns (AMX's "VNNI" layout: 4 consecutive columns of each row of W
//     side by side), the high nibbles the tile for its last 64.
//   scale_offset (N / 16, K / G, 2, 16) float32: per block of 16 rows and group, the 16 scales then the 16
//     offsets (one vector each); w = s * q + o as in the row-major layout.
//
// Rows of x: 10 a pass (two A tiles of 5 rows' 15 planes, two C tiles, sharing each block's split and B
// tiles), W re-read per pass, at every M: there is no dequantize-and-matmul cut-over as in the row-major
// layout. Measured on one thread of the 2-core Xeon (8 of the 95M model's projections, CPU seconds): 1.81 ms at
// 64 rows against the row-major layout's 5.64, and at 128 and 512 rows 3.54 and 13.8 ms against its
// dequantize-and-matmul's 10.1 and 32.6: int8 products on the tile unit, three planes and a pass per 10 rows
// included, outrun float32 FMAs.
//
// x's planes: per 128 columns, x ~= u (65536 xh + 256 xm + xl), balanced base-256 digits of round(x / u),
// u = max|x_chunk| / (127 * 65536), exactly as cpu_linear_int4.cpp's make_planes (|error| <= 6e-8 of the chunk's
// largest |x|). Per chunk and row of x: sum q x = u (256 (256 Ch + Cm) + Cl), 256 Ch + Cm exact in int32
// (|.| < 2^26), then float32, times the group's scale; offsets: sum_g o_g * sum_{k in g} x_k once per block.
#include "cpu_linear.h"
#include "cpu_linear_int4.h"
#include "group_dots.h"
#include "int4_planes.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

namespace tpserve_int4_tiles {

constexpr int64_t kRows = 16;          // rows of W per block (B's 16 columns of int32)
constexpr int64_t kChunk = 128;        // columns per block (two B tiles of 64)
constexpr int64_t kBlockBytes = 1024;  // codes per block
constexpr int kGroupX = 5;             // rows of x per A tile: 3 planes each within its 16 rows
constexpr int64_t kMaxX = 10;          // rows of x per pass: two A tiles (and two C) share B's
static_assert(kMaxX == kMaxRowsPerPass);
constexpr int64_t kAhead = 2048;       // bytes of W prefetched ahead of the block being split (two blocks)
constexpr int kLead = 2;               // blocks split ahead of the block multiplied (run_blocks)

#define TPSERVE_INT4_TILES __attribute__((target("avx512f,avx512vl,avx512bw,amx-tile,amx-int8")))

using tpserve_int4::TileConfig;

// x's planes in A's layout: per chunk c, half h (columns 128 c + 64 h ..), plane row 3 r + p (p: high, middle,
// low digit), 64 bytes; and units[r * chunks + c] = u (0 for a chunk of zeros, whose planes stay zero).
// Digits as cpu_linear_int4.cpp's make_planes.
TPSERVE_INT4_TILES void make_a_planes(const float* x, int64_t R, int64_t K, int8_t* a, float* units) {
  const int64_t chunks = K / kChunk, P = 3 * R;
  std::memset(a, 0, static_cast<size_t>(chunks * 2 * P * 64));
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < chunks; ++c) {
      const float* xc = x + r * K + c * kChunk;
      const float unit = tpserve_int4::chunk_max_abs(xc) / (127.0f * 65536.0f);
      units[r * chunks + c] = unit;
      if (unit == 0.0f) continue;  // zeros, or below 1e-31 (u underflows): the chunk's planes stay zero
      const __m512 u = _mm512_set1_ps(unit);
      for (int64_t i = 0; i < kChunk / 16; ++i) {  // columns 16 i .. 16 i + 15 of the chunk
        __m512i xh, xm, xl;
        tpserve_int4::plane_digits(xc + 16 * i, u, xh, xm, xl);
        int8_t* dst = a + ((c * 2 + i / 4) * P + 3 * r) * 64 + (i % 4) * 16;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(xh));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 64), _mm512_cvtepi32_epi8(xm));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 128), _mm512_cvtepi32_epi8(xl));
      }
    }
  }
}

// What the AMX and VNNI kernels share, so that they give the same bits: one chunk's three plane sums for 16 rows of
// W (ch, cm, cl: C's rows, exact int32) folded into a row of x's totals, and a block row's 16 outputs stored.
#define TPSERVE_INT4_FOLD __attribute__((target("avx512f")))

// acc += (256 (256 ch + cm) + cl) u s_g: 256 ch + cm exact in int32 (|.| < 2^26), then float32.
TPSERVE_INT4_FOLD inline __m512 fold_chunk(__m512i ch, __m512i cm, __m512i cl, float u, __m512 scale, __m512 acc) {
  const __m512 upper = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ch, 8), cm));
  const __m512 sum = _mm512_fmadd_ps(upper, _mm512_set1_ps(256.0f * u),
                                     _mm512_mul_ps(_mm512_cvtepi32_ps(cl), _mm512_set1_ps(u)));
  return _mm512_fmadd_ps(sum, scale, acc);
}

// y's columns 16 t .. 16 t + 15 of row r of x: acc + sum_g o_g xsum_g (+ bias), the offsets summed group by group.
TPSERVE_INT4_FOLD inline void store_block_row(__m512 acc, int64_t r, int64_t t, int64_t groups, const float* so,
                                              const float* xsum, const float* bias, int64_t N, float* y) {
  const int64_t n0 = t * kRows;
  __m512 off = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    off = _mm512_fmadd_ps(_mm512_loadu_ps(so + ((t * groups + g) * 2 + 1) * 16), _mm512_set1_ps(xsum[r * groups + g]),
                          off);
  }
  const __m512 b16 = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  _mm512_storeu_ps(y + r * N + n0, _mm512_add_ps(_mm512_add_ps(acc, off), b16));
}

// One block's codes (1,024 bytes) split into B's two tiles: low nibbles to lo, high ones to hi (L1 buffers).
TPSERVE_INT4_TILES inline void split_block(const uint8_t* w, uint8_t* lo, uint8_t* hi) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < 16; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + 64 * r), _MM_HINT_T0);
    const __m512i bytes = _mm512_loadu_si512(w + 64 * r);
    _mm512_store_si512(lo + 64 * r, _mm512_and_si512(bytes, low));
    _mm512_store_si512(hi + 64 * r, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low));
  }
}

// Blocks of rows [t0, t1) against R rows of x, one block a step, as a software pipeline over a ring of
// kLead + 1 B buffers: step i splits block i + kLead, runs block i's two tdpbsud and stores its C, then folds
// step i - 1's C into the rows' totals. Why the distances (measured on the 2-core Xeon, W in L2, one row of
// x): a tile load of lines still in the store buffer waits for them to drain, so splitting a block and
// loading it as tiles in the same step took 42 ns a block where either alone took 13 and 17; reading a C
// tile store back at once stalls the same way (cpu_linear_int4_amx.cpp), hence C's two buffers.
template <int R>
TPSERVE_INT4_TILES void run_blocks(int64_t t0, int64_t t1, int64_t K, int64_t N, int64_t G, const uint8_t* qweight,
                                   const float* so, const int8_t* a, const float* units, const float* xsum,
                                   const float* bias, float* y) {
  constexpr int P = 3 * R;
  const int64_t chunks = K / kChunk, groups = K / G, per_group = G / kChunk;
  TileConfig cfg;
  constexpr int P0 = 3 * std::min(R, kGroupX), P1 = P - P0;  // planes of the first and second A tiles
  for (int t : {0, 1}) cfg.rows[t] = 16, cfg.colsb[t] = 64;    // B: low, high nibbles
  for (int t : {2, 3, 4}) cfg.rows[t] = P0, cfg.colsb[t] = 64;  // A: first, last 64 columns; C
  if constexpr (P1 > 0) {
    for (int t : {5, 6, 7}) cfg.rows[t] = P1, cfg.colsb[t] = 64;  // rows 5.. of x: their A and C
  }
  _tile_loadconfig(&cfg);
  alignas(64) uint8_t b[kLead + 1][2][kBlockBytes];
  alignas(64) int32_t c_out[2][P * 16];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t steps = (t1 - t0) * chunks;
  const uint8_t* w = qweight + t0 * chunks * kBlockBytes;  // block i is w + i * kBlockBytes
  for (int64_t i = 0; i < std::min<int64_t>(kLead, steps); ++i) split_block(w + i * kBlockBytes, b[i][0], b[i][1]);
  int64_t t = t0, c = 0;  // step i's block
  for (int64_t i = 0; i <= steps; ++i) {
    const int64_t t_prev = c == 0 ? t - 1 : t, c_prev = c == 0 ? chunks - 1 : c - 1;
    if (i + kLead < steps) {
      uint8_t(*next)[kBlockBytes] = b[(i + kLead) % (kLead + 1)];
      split_block(w + (i + kLead) * kBlockBytes, next[0], next[1]);
    }
    if (i < steps) {
      uint8_t(*cur)[kBlockBytes] = b[i % (kLead + 1)];
      const int8_t* ac = a + c * 2 * P * 64;
      _tile_loadd(0, cur[0], 64);
      _tile_loadd(1, cur[1], 64);
      _tile_loadd(2, ac, 64);
      _tile_loadd(3, ac + P * 64, 64);
      _tile_zero(4);
      _tile_dpbsud(4, 2, 0);
      _tile_dpbsud(4, 3, 1);
      _tile_stored(4, c_out[i & 1], 64);
      if constexpr (P1 > 0) {  // C's rows P0.. (planes of rows 5.. of x) from the same B tiles
        _tile_loadd(5, ac + P0 * 64, 64);
        _tile_loadd(6, ac + (P + P0) * 64, 64);
        _tile_zero(7);
        _tile_dpbsud(7, 5, 0);
        _tile_dpbsud(7, 6, 1);
        _tile_stored(7, c_out[i & 1] + P0 * 16, 64);
      }
    }
    if (++c == chunks) c = 0, ++t;
    if (i == 0) continue;
    const int32_t* cp = c_out[(i - 1) & 1];
    const float* sg = so + ((t_prev * groups + c_prev / per_group) * 2) * 16;  // 16 scales, then 16 offsets
    const __m512 scale = _mm512_loadu_ps(sg);
    for (int r = 0; r < R; ++r) {
      const __m512i ch = _mm512_load_si512(cp + 16 * (3 * r)), cm = _mm512_load_si512(cp + 16 * (3 * r + 1));
      const __m512i cl = _mm512_load_si512(cp + 16 * (3 * r + 2));
      acc[r] = fold_chunk(ch, cm, cl, units[r * chunks + c_prev], scale, acc[r]);
    }
    if (c_prev != chunks - 1) continue;
    for (int r = 0; r < R; ++r) {
      store_block_row(acc[r], r, t_prev, groups, so, xsum, bias, N, y);
      acc[r] = _mm512_setzero_ps();
    }
  }
  _tile_release();
}

// ---- The same products on AVX512-VNNI (a CPU without AMX-INT8) -----------------------------------------
// The tile layout suits vpdpbusd as it is: each 64-byte row r of a block holds 4 consecutive columns of each of
// the 16 rows of W side by side, so one instruction multiplies 16 rows of W (one int32 lane each) by x's 4
// columns 4 r .. 4 r + 3 of one plane, broadcast from memory: a lane is one row of W, and the chunk's sums come
// out as AMX's C (the same integers, exact), folded by the same float32 arithmetic: the two kernels' y are the
// same bits. Against the row-major layout's VNNI path (cpu_linear_int4.cpp), whose lanes are 64 columns of one
// row of W, the fold (combine three int32 sums, two conversions, two FMAs) is paid once per 16 rows of W, not
// per row: port 0 does 6 vpdpbusd, 1 shift and ~0.2 of a fold per 128 weights against about 10.5
// (kernels.md, "int4": the tile layout without AMX). Rows of x 4 at a time against a block (6 int32
// accumulators each, the low and high nibbles' apart so that each chain is 16 long, under vpdpbusd's latency
// times the 6 accumulators' throughput); a block's codes are split once per 4 rows of x, from L1.
#define TPSERVE_INT4_TILES_VNNI __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni")))

constexpr int kVnniRows = 4;  // rows of x per pass over a block's codes (24 accumulators of 32 registers)
constexpr int64_t kVnniMaxRows = 16;  // rows of x up to which linear_op takes the VNNI kernel
constexpr int64_t kRowsMaxRows = 64;  // beyond kVnniMaxRows up to here, dequantized rows and float32 tiles

// The tile unit where the CPU has one and use_amx_int4 leaves it on; else the VNNI kernels below.
bool use_amx() { return tpserve_int4::amx_allowed() && tpserve_int4_amx::amx_available(); }
bool supported() { return tpserve_int4_amx::amx_available() || tpserve_int4::cpu_has_vnni(); }
bool run_rows_take(int64_t M) { return use_amx() || M <= kVnniMaxRows; }

// x's 4 bytes of one plane at p as 16 equal int32 lanes (vpbroadcastd from memory, a load-port operation).
TPSERVE_INT4_TILES_VNNI inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Rows m0 .. m0 + RR - 1 of x against one block (codes w, 1,024 bytes; x's planes of its chunk at ac, in A's
// layout): each row's three plane sums for the block's 16 rows of W, folded into acc[m] as run_blocks folds C
// (fold_chunk).
template <int RR>
TPSERVE_INT4_TILES_VNNI inline void fold_block_vnni(const uint8_t* w, const int8_t* ac, int P, int m0, __m512 scale,
                                                    const float* units_c, int64_t chunks, __m512* acc) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i sum[RR][2][3];  // [row of x][low, high nibbles][plane]
  for (int m = 0; m < RR; ++m)
    for (int h = 0; h < 2; ++h)
      for (int p = 0; p < 3; ++p) sum[m][h][p] = _mm512_setzero_si512();
  for (int r = 0; r < 16; ++r) {
    const __m512i bytes = _mm512_loadu_si512(w + 64 * r);
    const __m512i lo = _mm512_and_si512(bytes, low);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
    for (int m = 0; m < RR; ++m) {
      for (int p = 0; p < 3; ++p) {
        const int8_t* row = ac + (3 * (m0 + m) + p) * 64 + 4 * r;  // half 0: the chunk's first 64 columns
        sum[m][0][p] = _mm512_dpbusd_epi32(sum[m][0][p], lo, broadcast4(row));
        sum[m][1][p] = _mm512_dpbusd_epi32(sum[m][1][p], hi, broadcast4(row + P * 64));
      }
    }
  }
  for (int m = 0; m < RR; ++m) {
    const __m512i ch = _mm512_add_epi32(sum[m][0][0], sum[m][1][0]);
    const __m512i cm = _mm512_add_epi32(sum[m][0][1], sum[m][1][1]);
    const __m512i cl = _mm512_add_epi32(sum[m][0][2], sum[m][1][2]);
    acc[m0 + m] = fold_chunk(ch, cm, cl, units_c[(m0 + m) * chunks], scale, acc[m0 + m]);
  }
}

// run_blocks on VNNI: blocks of rows [t0, t1) against R rows of x, folded and stored by the same functions.
template <int R>
TPSERVE_INT4_TILES_VNNI void run_blocks_vnni(int64_t t0, int64_t t1, int64_t K, int64_t N, int64_t G,
                                             const uint8_t* qweight, const float* so, const int8_t* a,
                                             const float* units, const float* xsum, const float* bias, float* y) {
  constexpr int P = 3 * R, full = R / kVnniRows, rest = R % kVnniRows;
  const int64_t chunks = K / kChunk, groups = K / G, per_group = G / kChunk;
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const uint8_t* w = qweight + (t * chunks + c) * kBlockBytes;
      for (int r = 0; r < 16; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + 64 * r), _MM_HINT_T0);
      const int8_t* ac = a + c * 2 * P * 64;
      const __m512 scale = _mm512_loadu_ps(so + ((t * groups + c / per_group) * 2) * 16);
      for (int g = 0; g < full; ++g) fold_block_vnni<kVnniRows>(w, ac, P, g * kVnniRows, scale, units + c, chunks, acc);
      if constexpr (rest > 0) fold_block_vnni<rest>(w, ac, P, full * kVnniRows, scale, units + c, chunks, acc);
    }
    for (int r = 0; r < R; ++r) store_block_row(acc[r], r, t, groups, so, xsum, bias, N, y);
  }
}

size_t plane_bytes(int64_t R, int64_t K) { return static_cast<size_t>(K / kChunk * 2 * 3 * R * 64); }

void prepare_rows(const float* x, int64_t R, int64_t K, int64_t G, int8_t* a, float* units, float* xsum) {
  make_a_planes(x, R, K, a, units);
  tpserve_int4::group_sums512(x, R, K, G, xsum);
}

// f(std::integral_constant<int, R>) for R in 1 .. kMaxX (a pass's rows of x as a template argument).
template <typename F>
void with_rows(int64_t R, F&& f) {
  switch (R) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 9: f(std::integral_constant<int, 9>{}); break;
    default: f(std::integral_constant<int, 10>{}); break;
  }
}

void run_rows(int64_t R, int64_t t0, int64_t t1, int64_t K, int64_t N, int64_t G, const uint8_t* qweight,
              const float* scale_offset, const int8_t* a, const float* units, const float* xsum, const float* bias,
              float* y) {
  if (t0 >= t1) return;
  const bool amx = use_amx();
  with_rows(R, [&](auto rows) {
    constexpr int RR = decltype(rows)::value;
    if (amx) {
      run_blocks<RR>(t0, t1, K, N, G, qweight, scale_offset, a, units, xsum, bias, y);
    } else {
      run_blocks_vnni<RR>(t0, t1, K, N, G, qweight, scale_offset, a, units, xsum, bias, y);
    }
  });
}

void linear(const float* x, int64_t M, int64_t K, int64_t N, int64_t G, const uint8_t* qweight,
            const float* scale_offset, const float* bias, float* y) {
  const int64_t chunks = K / kChunk, groups = K / G, blocks = N / kRows;
  thread_local std::vector<int8_t> a;
  thread_local std::vector<float> units, xsum;
  const int64_t grain = std::max<int64_t>(1, blocks / (4 * at::get_num_threads()));
  for (int64_t m0 = 0; m0 < M; m0 += kMaxX) {
    const int64_t R = std::min(kMaxX, M - m0);
    a.resize(plane_bytes(R, K));
    units.resize(static_cast<size_t>(R * chunks));
    xsum.resize(static_cast<size_t>(R * groups));
    prepare_rows(x + m0 * K, R, K, G, a.data(), units.data(), xsum.data());
    const int8_t* ap = a.data();
    const float* up = units.data();
    const float* sp = xsum.data();
    float* yp = y + m0 * N;
    at::parallel_for(0, blocks, grain, [&](int64_t t0, int64_t t1) {
      run_rows(R, t0, t1, K, N, G, qweight, scale_offset, ap, up, sp, bias, yp);
    });
  }
}

// W as float32 (N, K) from the tile layout (prefill-sized products without AMX, tests): w = s * q + o, a product
// then a sum (two roundings), as the row-major layout's dequantize_int4: the two layouts give the same floats. A block's 64-byte row r holds 4 columns of each of
// its 16 rows of W: its low nibbles widen to 4 vectors of 4 rows x 4 columns (4 r .. 4 r + 3), stored 16 bytes
// a row, its high nibbles likewise at columns 64 + 4 r.
TPSERVE_INT4_TILES_VNNI void dequantize_band(const uint8_t* band, const float* so_band, int64_t K, int64_t G,
                                             float* w) {
  const int64_t chunks = K / kChunk;
  const __m128i low = _mm_set1_epi8(0x0F);
  // lane l of a vector of 4 rows q .. holds row 4 q + l / 4: the scales' and offsets' permutation of each q
  __m512i spread[4];
  for (int q = 0; q < 4; ++q) {
    alignas(64) int32_t idx[16];
    for (int l = 0; l < 16; ++l) idx[l] = 4 * q + l / 4;
    spread[q] = _mm512_load_si512(idx);
  }
  alignas(64) float tile[kRows][kChunk];  // one block's floats, written in L1 then copied out a row at a time
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* block = band + c * kBlockBytes;
    const float* sg = so_band + (c * kChunk / G) * 2 * 16;
    const __m512 s16 = _mm512_loadu_ps(sg), o16 = _mm512_loadu_ps(sg + 16);
    __m512 s4[4], o4[4];
    for (int q = 0; q < 4; ++q) {
      s4[q] = _mm512_permutexvar_ps(spread[q], s16);
      o4[q] = _mm512_permutexvar_ps(spread[q], o16);
    }
    for (int64_t r = 0; r < 16; ++r) {
      for (int q = 0; q < 4; ++q) {  // bytes 16 q .. 16 q + 15: rows 4 q .. 4 q + 3
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64 * r + 16 * q));
        const __m512 lo = _mm512_add_ps(
            _mm512_mul_ps(s4[q], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low)))), o4[q]);
        const __m512 hi = _mm512_add_ps(
            _mm512_mul_ps(s4[q], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low)))),
            o4[q]);
        for (int l = 0; l < 4; ++l) {
          float* row = &tile[4 * q + l][4 * r];
          _mm_store_ps(row, _mm512_extractf32x4_ps(lo, l));
          _mm_store_ps(row + 64, _mm512_extractf32x4_ps(hi, l));
        }
      }
    }
    for (int64_t j = 0; j < kRows; ++j) {
      for (int64_t k = 0; k < kChunk; k += 16) _mm512_storeu_ps(w + j * K + c * kChunk + k, _mm512_load_ps(&tile[j][k]));
    }
  }
}

void dequantize(const uint8_t* qweight, const float* scale_offset, int64_t N, int64_t K, int64_t G, float* w) {
  const int64_t chunks = K / kChunk, groups = K / G;
  at::parallel_for(0, N / kRows, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      dequantize_band(qweight + t * chunks * kBlockBytes, scale_offset + t * groups * 2 * 16, K, G, w + t * kRows * K);
    }
  });
}

void check(const at::Tensor& qweight, const at::Tensor& scale_offset) {
  TORCH_CHECK(qweight.device().is_cpu() && scale_offset.device().is_cpu(), "tpserve int4: tensors must be on the CPU");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "tpserve int4: qweight must be a contiguous uint8 (N, K / 2) tensor");
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  TORCH_CHECK(scale_offset.scalar_type() == at::kFloat && scale_offset.dim() == 4 && scale_offset.is_contiguous() &&
                  scale_offset.size(0) * kRows == N && scale_offset.size(2) == 2 && scale_offset.size(3) == kRows,
              "tpserve int4: the tile layout's scale_offset must be a contiguous float32 (N / 16, K / G, 2, 16) tensor");
  const int64_t groups = scale_offset.size(1);
  TORCH_CHECK(N % kRows == 0 && K % kChunk == 0 && groups > 0 && K % groups == 0 && (K / groups) % kChunk == 0,
              "tpserve int4: the tile layout needs N % 16 == 0, K % 128 == 0 and groups of a multiple of 128 "
              "columns, got N=", N, " K=", K, " groups=", groups);
  TORCH_CHECK(supported(), "tpserve int4: the tile layout needs AMX-INT8 or AVX512-VNNI");
}

at::Tensor dequantize_op(const at::Tensor& qweight, const at::Tensor& scale_offset) {
  check(qweight, scale_offset);
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2, G = K / scale_offset.size(1);
  at::Tensor w = at::empty({N, K}, scale_offset.options());
  dequantize(qweight.data_ptr<uint8_t>(), scale_offset.data_ptr<float>(), N, K, G, w.data_ptr<float>());
  return w;
}

// Row n of W as float32 from the tile layout, w = s * q + o as dequantize_band: per chunk, row j's 4 bytes of
// each of the block's 16 rows r (stride 64) gathered into one vector, whose bytes are then the chunk's columns
// in order (low nibbles: 0 .. 63, high: 64 .. 127).
TPSERVE_INT4_TILES_VNNI void dequantize_row(const uint8_t* qweight, const float* scale_offset, int64_t n, int64_t K,
                                            int64_t G, float* out) {
  const int64_t chunks = K / kChunk, groups = K / G, t = n / kRows, j = n % kRows;
  const __m512i index = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5,
                                                                             4, 3, 2, 1, 0),
                                                            _mm512_set1_epi32(64)),
                                         _mm512_set1_epi32(static_cast<int>(4 * j)));
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* block = qweight + (t * chunks + c) * kBlockBytes;
    const float* sg = scale_offset + ((t * groups + c * kChunk / G) * 2) * 16;
    const __m512 s = _mm512_set1_ps(sg[j]), o = _mm512_set1_ps(sg[16 + j]);
    const __m512i bytes = _mm512_i32gather_epi32(index, block, 1);
    alignas(64) uint8_t codes[128];
    _mm512_store_si512(codes, _mm512_and_si512(bytes, low));
    _mm512_store_si512(codes + 64, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low));
    for (int i = 0; i < 8; ++i) {
      const __m128i q = _mm_load_si128(reinterpret_cast<const __m128i*>(codes + 16 * i));
      _mm512_storeu_ps(out + c * kChunk + 16 * i,
                       _mm512_add_ps(_mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q))), o));
    }
  }
}

at::Tensor linear_op(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale_offset,
                     const c10::optional<at::Tensor>& bias) {
  check(qweight, scale_offset);
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) * 2 == K, "tpserve linear_int4: x has ", K, " columns, W ", qweight.size(1) * 2);
  if (!use_amx() && M > kVnniMaxRows) {
    // Without AMX, past kVnniMaxRows rows of x the VNNI kernel's three planes a row cost more than float32
    // FMAs on dequantized rows (kernels.md, "int4": the tile layout without AMX): up to kRowsMaxRows, each row
    // of W dequantized once into L1 and multiplied by linear_f32's tiles, as the row-major layout does; beyond,
    // W dequantized once and at::matmul.
    const uint8_t* qp = qweight.data_ptr<uint8_t>();
    const float* sp = scale_offset.data_ptr<float>();
    const int64_t G = K / scale_offset.size(1);
    if (M > kRowsMaxRows) return tpserve::dequantized_matmul(x, dequantize_op(qweight, scale_offset), bias);
    return tpserve::tiles_from_rows(x, N, bias, [=](int64_t n, float* buffer) {
      dequantize_row(qp, sp, n, K, G, buffer);
      return static_cast<const float*>(buffer);
    });
  }
  at::Tensor y = at::empty({M, N}, x.options());
  linear(x.data_ptr<float>(), M, K, N, K / scale_offset.size(1), qweight.data_ptr<uint8_t>(),
         scale_offset.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

// Whether layers loaded from now on are repacked into the tile layout (worker/layers/int4_weights.py asks
// int4_tiles_enabled); use_int4_tiles(False) keeps the row-major layout (tests, A/B runs).
std::atomic<bool> allow_tiles{true};
bool use_int4_tiles(bool enabled) {
  allow_tiles.store(enabled);
  return enabled && supported();
}
bool int4_tiles_enabled() { return allow_tiles.load() && supported(); }

}  // namespace tpserve_int4_tiles

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("use_int4_tiles(bool enabled) -> bool", &tpserve_int4_tiles::use_int4_tiles);
  m.def("int4_tiles_enabled() -> bool", &tpserve_int4_tiles::int4_tiles_enabled);
  m.def("int4_tiles_take_rows(int rows) -> bool", &tpserve_int4_tiles::run_rows_take);
}
