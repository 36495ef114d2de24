// linear_int4 on AMX-INT8 tiles (Sapphire Rapids and later): the codes as bytes times x as three int8 planes.
//
// Why: the AVX512-VNNI path (cpu_linear_int4.cpp, dots_vnni) carries x as 24-bit fixed point in three int8
// planes, so each 64 codes cost three vpdpbusd plus their combination: about 11 cycles per 128 weights on the
// 2-core Xeon host, slower than the host reads 4-bit weights from its last-level cache, so int4 decoded at
// int8's speed. One tdpbusd multiplies a 16 x 64 tile of codes into up to 16 columns of 64 int8 values (the
// planes of up to 5 rows of x) at 1,024 weights an instruction on the tile unit, which runs beside the vector
// ports; what is left to them is the nibbles' unpacking (2-3 instructions per 64 weights) and a per-chunk
// epilogue. Same arithmetic as dots_vnni: integer products exact, planes combined in float32.
//
// Tiles (A u8 x B s8 -> C int32, tdpbusd):
//   A (16 rows of W, 64 bytes): one row's 64-byte load of codes (128 columns, one chunk) masked into its low
//     nibbles (A_lo: columns 32b + j, b = 0..3, j < 16) and high ones (A_hi: 32b + 16 + j), written to L1 and
//     loaded as two tiles: the qweight layout of cpu_linear_int4.cpp unchanged.
//   B (16 rows of 4 columns of x, 12 R bytes): B[i][4m + j] = plane p of row r of x at A's column 4i + j,
//     m = 3r + p, built per call in that column order (make_b_planes).
//   C (16 rows of W, 12 R bytes): C[n][m] = sum over the chunk of q * plane; per chunk and row of W,
//     acc_n += (C_n * (u 65536, u 256, u)) * s_g in float32 (u: the chunk's unit, s_g: the group's scale).
#include "cpu_linear_int4.h"
#include "int4_planes.h"

#include <ATen/Parallel.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace tpserve_int4_amx {

constexpr int64_t kTileRows = 16;   // rows of W per tile
constexpr int64_t kChunk = 128;     // columns per 64-byte load of codes (two tiles: low and high nibbles)
constexpr int64_t kMaxRows = 5;     // rows of x per pass: 3 planes each within a tile's 16 columns
constexpr int64_t kTileBytes = 16 * 64;
constexpr int64_t kAheadRows = 16;  // prefetch distance in rows of W: the next tile (32 measured no faster)

#define TPSERVE_INT4_AMX __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")))

using tpserve_int4::TileConfig;

bool amx_available() {
  static const bool ok = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!(edx & (1u << 24)) || !(edx & (1u << 25))) return false;  // AMX-TILE, AMX-INT8
    if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// x's planes in B's layout: per row block of 5, chunk c, low then high tile, 16 rows of 12 R bytes; and per
// chunk the 16 plane weights (u 65536, u 256, u per row of x; zero beyond 3 R). Digits as make_planes's.
TPSERVE_INT4_AMX void make_b_planes(const float* x, int64_t R, int64_t K, int8_t* b, float* weights) {
  const int64_t chunks = K / kChunk, stride = 12 * R, tile = 16 * stride;
  std::memset(weights, 0, sizeof(float) * 16 * chunks);
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11, 12, 13, 14, 15);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < chunks; ++c) {
      const float* xc = x + r * K + c * kChunk;
      int8_t* bc = b + c * 2 * tile + 12 * r;
      const float top = tpserve_int4::chunk_max_abs(xc);
      const float unit = top == 0.0f ? 0.0f : top / (127.0f * 65536.0f);
      weights[c * 16 + 3 * r] = unit * 65536.0f;
      weights[c * 16 + 3 * r + 1] = unit * 256.0f;
      weights[c * 16 + 3 * r + 2] = unit;
      const __m512 u = _mm512_set1_ps(top == 0.0f ? 1.0f : unit);
      for (int64_t i = 0; i < kChunk / 16; ++i) {  // columns 16i..16i+15: block i / 2, low (even i) or high half
        __m512i xh, xm, xl;
        tpserve_int4::plane_digits(xc + 16 * i, u, xh, xm, xl);
        // dwords 0-3: xh's 16 digits, 4-7: xm's, 8-11: xl's; reordered so each tile row's 12 bytes lie together.
        __m512i all = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(xh));
        all = _mm512_inserti32x4(all, _mm512_cvtepi32_epi8(xm), 1);
        all = _mm512_inserti32x4(all, _mm512_cvtepi32_epi8(xl), 2);
        all = _mm512_permutexvar_epi32(order, all);
        // These 16 columns are A's columns 16 (i / 2) .. + 15 of the low (even i) or high tile: B rows 4 (i / 2) ..
        int8_t* dst = bc + (i % 2) * tile + 4 * (i / 2) * stride;
        if (R == 1) {
          _mm512_mask_storeu_epi32(dst, 0x0FFF, all);
        } else {
          alignas(64) int8_t tmp[64];
          _mm512_store_si512(tmp, all);
          for (int row = 0; row < 4; ++row) std::memcpy(dst + row * stride, tmp + 12 * row, 12);
        }
      }
    }
  }
}

// W's tiles [t0, t1) against R rows of x (R <= 5), one chunk (16 rows x 128 columns) a step. A chunk's C is
// read back one step later: vector loads of a tile store still in the store buffer (behind the next A's
// 32 stores) stalled the core, 3.7x the time of either alone (measured, L2-resident W), so step i issues
// its tiles, then folds step i - 1's C into the row totals, from the other of two buffers. Loops start on a
// 64-byte line: the fold's loop (about 190 bytes of code) ran 6-8% slower at 4 rows of x where the function's
// place in the library left it across 4 lines instead of 3 (measured, 2-core Xeon).
TPSERVE_INT4_AMX __attribute__((optimize("align-loops=64"))) void run_tiles(int64_t t0, int64_t t1, int64_t R, int64_t K, int64_t N, int64_t G,
                                const uint8_t* qweight, const float* so, const int8_t* b, const float* weights,
                                const float* xsum, const float* bias, float* y) {
  const int64_t chunks = K / kChunk, groups = K / G, per_group = G / kChunk, stride = 12 * R;
  const int64_t row_bytes = K / 2, tile = 16 * stride;
  TileConfig cfg;
  for (int t : {0, 1}) cfg.rows[t] = 16, cfg.colsb[t] = 64;                                // A_lo, A_hi
  for (int t : {2, 3, 4}) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(stride);  // B_lo, B_hi, C
  _tile_loadconfig(&cfg);
  alignas(64) uint8_t a[2][2 * kTileBytes];  // A_lo and A_hi of steps i and i - 1
  alignas(64) int32_t c_out[2][16 * 16];     // C of steps i and i - 1 (columns past 3 R stay zero)
  std::memset(c_out, 0, sizeof(c_out));
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[16];
  for (int n = 0; n < 16; ++n) acc[n] = _mm512_setzero_ps();
  // Step i issues chunk i's tiles (i < steps), then folds step i - 1's C into acc (i > 0); after a tile's
  // last chunk, its rows of y. (One loop, not a helper: acc must stay in registers.)
  const int64_t steps = (t1 - t0) * chunks;
  int64_t t = t0, c = 0;  // step i's tile and chunk
  for (int64_t i = 0; i <= steps; ++i) {
    const int64_t t_prev = c == 0 ? t - 1 : t, c_prev = c == 0 ? chunks - 1 : c - 1;  // step i - 1's
    if (i < steps) {
      const uint8_t* w = qweight + t * kTileRows * row_bytes + c * 64;
      uint8_t* ac = a[i & 1];
      for (int n = 0; n < 16; ++n) {
        const uint8_t* p = w + n * row_bytes;
        _mm_prefetch(reinterpret_cast<const char*>(p + kAheadRows * row_bytes), _MM_HINT_T0);
        const __m512i bytes = _mm512_loadu_si512(p);
        _mm512_store_si512(ac + n * 64, _mm512_and_si512(bytes, low));
        _mm512_store_si512(ac + kTileBytes + n * 64, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low));
      }
      _tile_loadd(0, ac, 64);
      _tile_loadd(1, ac + kTileBytes, 64);
      _tile_loadd(2, b + c * 2 * tile, stride);
      _tile_loadd(3, b + c * 2 * tile + tile, stride);
      _tile_zero(4);
      _tile_dpbusd(4, 0, 2);
      _tile_dpbusd(4, 1, 3);
      _tile_stored(4, c_out[i & 1], 64);
    }
    if (++c == chunks) c = 0, ++t;
    if (i == 0) continue;
    const int64_t n0 = t_prev * kTileRows;
    const int32_t* cp = c_out[(i - 1) & 1];
    const __m512 pw = _mm512_loadu_ps(weights + c_prev * 16);
    const float* sc = so + (n0 * groups + c_prev / per_group) * 2;
    for (int n = 0; n < 16; ++n) {
      const __m512 sum = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cp + 16 * n)), pw);
      acc[n] = _mm512_fmadd_ps(sum, _mm512_set1_ps(sc[n * groups * 2]), acc[n]);
    }
    if (c_prev != chunks - 1) continue;
    for (int n = 0; n < 16; ++n) {
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, acc[n]);
      acc[n] = _mm512_setzero_ps();
      const float* o = so + (n0 + n) * groups * 2 + 1;
      for (int64_t r = 0; r < R; ++r) {
        float offset = 0.0f;
        for (int64_t g = 0; g < groups; ++g) offset += o[2 * g] * xsum[r * groups + g];
        y[r * N + n0 + n] = (lanes[3 * r] + lanes[3 * r + 1] + lanes[3 * r + 2]) + offset + (bias ? bias[n0 + n] : 0.0f);
      }
    }
  }
  _tile_release();
}

void linear(const float* x, int64_t M, int64_t K, int64_t N, int64_t G, const uint8_t* qweight,
            const float* scale_offset, const float* bias, float* y) {
  const int64_t chunks = K / kChunk, groups = K / G, tiles = N / kTileRows;
  thread_local std::vector<int8_t> b;
  thread_local std::vector<float> weights, xsum;
  const int64_t grain = std::max<int64_t>(1, tiles / (4 * at::get_num_threads()));
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int64_t R = std::min(kMaxRows, M - m0);
    b.resize(static_cast<size_t>(chunks * 2 * 16 * 12 * R));
    weights.resize(static_cast<size_t>(chunks * 16));
    xsum.resize(static_cast<size_t>(R * groups));
    make_b_planes(x + m0 * K, R, K, b.data(), weights.data());
    tpserve_int4::group_sums512(x + m0 * K, R, K, G, xsum.data());
    const int8_t* bp = b.data();
    const float* wp = weights.data();
    const float* sp = xsum.data();
    at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
      run_tiles(t0, t1, R, K, N, G, qweight, scale_offset, bp, wp, sp, bias, y + m0 * N);
    });
  }
}

}  // namespace tpserve_int4_amx
