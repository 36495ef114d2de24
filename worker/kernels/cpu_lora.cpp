// Batched LoRA for a step whose rows use different adapters: punica's BGMV (Chen et al. 2023,
// arXiv:2310.18547) on the CPU, every row's shrink and expand in one call per projection.
//
//   y[t] += (x[t] @ A_s^T) @ B_s      for every row t whose adapter s = row_slots[t] >= 0
//
// with the layer's slot pool stacked as A (L, P*R, K) (peft's lora_A orientation) and B (L, P*R, N)
// (lora_B transposed, the scaling already in it; worker/layers/lora.py). The rows are grouped by
// adapter (a counting sort, once per call) into tiles of up to 4 rows (punica's SGMV segments), and
// each tile reads its adapter's A and B once: the shrink keeps the 4 rows' dot products with a row
// of A in registers, the expand keeps 4 rows' 8 outputs in registers across B's rows. A fused
// layer's B is block diagonal (part p's R rows reach only its part_widths[p] columns: q, k, v or
// gate, up), so the expand reads only each part's block, and only the rows of B whose
// intermediate is non-zero for the tile (a rank padded to --max-lora-rank, a part the adapter
// does not target, add nothing). The expand uses AVX-512 registers where the CPU has them (twice the
// columns per instruction), AVX2 + FMA elsewhere. Rows of no adapter (-1) are untouched, so a step
// mixing base rows and 8 adapters costs one call per projection.
//
// Why not torch ops: the module path's per-adapter index_select / mm / mm / index_add_ is four
// dispatches per adapter per projection; at decode sizes (a few rows, r = 16) the dispatch is most
// of the cost. Float32 only, like the decode block that calls it (cpu_decode_block.cpp). AVX2 + FMA.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "lora_share.h"
#include "vec_math.h"

namespace {

constexpr int64_t kRowsPerTile = 4;  // rows of one adapter that share each read of its A and B

// shrink for M rows of one adapter: tmp[i, j] = x[rows[i]] . A[j] (A (PR, K)), register accumulators over K,
// two rows of A at a time (each load of x serves both).
template <int M>
void shrink_tile(const float* xs, const float* a, const int64_t* rows, int64_t K, int64_t PR, float* tmp) {
  const float* xr[M];
  for (int i = 0; i < M; ++i) xr[i] = xs + rows[i] * K;
  int64_t j = 0;
  for (; j + 2 <= PR; j += 2) {
    const float* a0 = a + j * K;
    const float* a1 = a0 + K;
    __m256 acc0[M], acc1[M];
    for (int i = 0; i < M; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 va0 = _mm256_loadu_ps(a0 + k), va1 = _mm256_loadu_ps(a1 + k);
      for (int i = 0; i < M; ++i) {
        const __m256 vx = _mm256_loadu_ps(xr[i] + k);
        acc0[i] = _mm256_fmadd_ps(vx, va0, acc0[i]);
        acc1[i] = _mm256_fmadd_ps(vx, va1, acc1[i]);
      }
    }
    for (int i = 0; i < M; ++i) {
      float sum0 = tpserve::hsum(acc0[i]), sum1 = tpserve::hsum(acc1[i]);
      for (int64_t kk = k; kk < K; ++kk) sum0 += xr[i][kk] * a0[kk], sum1 += xr[i][kk] * a1[kk];
      tmp[i * PR + j] = sum0;
      tmp[i * PR + j + 1] = sum1;
    }
  }
  for (; j < PR; ++j) {  // an odd P * R
    for (int i = 0; i < M; ++i) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += xr[i][k] * a[j * K + k];
      tmp[i * PR + j] = sum;
    }
  }
}

// expand for M rows: y[rows[i], cols] += sum over j in `js` of tmp[i, j] * B[j, cols], cols = [offset, offset +
// width); register accumulators over j (16 columns of M rows), each B row segment read once for the M rows.
template <int M>
void expand_tile(const float* b, float* ys, const int64_t* rows, int64_t N, int64_t PR, const float* tmp,
                 const std::vector<int64_t>& js, int64_t offset, int64_t width) {
  float* yr[M];
  for (int i = 0; i < M; ++i) yr[i] = ys + rows[i] * N + offset;
  const float* bo = b + offset;
  int64_t n = 0;
  for (; n + 16 <= width; n += 16) {
    __m256 acc0[M], acc1[M];
    for (int i = 0; i < M; ++i) acc0[i] = _mm256_loadu_ps(yr[i] + n), acc1[i] = _mm256_loadu_ps(yr[i] + n + 8);
    for (int64_t j : js) {
      const __m256 vb0 = _mm256_loadu_ps(bo + j * N + n), vb1 = _mm256_loadu_ps(bo + j * N + n + 8);
      for (int i = 0; i < M; ++i) {
        const __m256 vt = _mm256_broadcast_ss(tmp + i * PR + j);
        acc0[i] = _mm256_fmadd_ps(vt, vb0, acc0[i]);
        acc1[i] = _mm256_fmadd_ps(vt, vb1, acc1[i]);
      }
    }
    for (int i = 0; i < M; ++i) _mm256_storeu_ps(yr[i] + n, acc0[i]), _mm256_storeu_ps(yr[i] + n + 8, acc1[i]);
  }
  for (; n + 8 <= width; n += 8) {
    __m256 acc[M];
    for (int i = 0; i < M; ++i) acc[i] = _mm256_loadu_ps(yr[i] + n);
    for (int64_t j : js) {
      const __m256 vb = _mm256_loadu_ps(bo + j * N + n);
      for (int i = 0; i < M; ++i) acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(tmp + i * PR + j), vb, acc[i]);
    }
    for (int i = 0; i < M; ++i) _mm256_storeu_ps(yr[i] + n, acc[i]);
  }
  for (; n < width; ++n) {
    for (int i = 0; i < M; ++i) {
      float sum = yr[i][n];
      for (int64_t j : js) sum += tmp[i * PR + j] * bo[j * N + n];
      yr[i][n] = sum;
    }
  }
}

#define TPSERVE_LORA_AVX512 __attribute__((target("avx512f")))

// Cleared by lora_use_avx512(False): tests run the AVX2 expand on AVX-512 machines too.
std::atomic<bool> lora_allow_avx512{true};

bool lora_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has && lora_allow_avx512.load(std::memory_order_relaxed);
}

bool lora_use_avx512(bool enabled) {
  lora_allow_avx512.store(enabled);
  return lora_avx512();
}

// expand_tile with 16-float registers (32 columns of M rows per pass) where the CPU has AVX-512; the
// columns past the last multiple of 16 go to the AVX2 expand_tile.
template <int M>
TPSERVE_LORA_AVX512 void expand_tile_avx512(const float* b, float* ys, const int64_t* rows, int64_t N, int64_t PR,
                                            const float* tmp, const std::vector<int64_t>& js, int64_t offset,
                                            int64_t width) {
  float* yr[M];
  for (int i = 0; i < M; ++i) yr[i] = ys + rows[i] * N + offset;
  const float* bo = b + offset;
  int64_t n = 0;
  for (; n + 32 <= width; n += 32) {
    __m512 acc0[M], acc1[M];
    for (int i = 0; i < M; ++i) acc0[i] = _mm512_loadu_ps(yr[i] + n), acc1[i] = _mm512_loadu_ps(yr[i] + n + 16);
    for (int64_t j : js) {
      const __m512 vb0 = _mm512_loadu_ps(bo + j * N + n), vb1 = _mm512_loadu_ps(bo + j * N + n + 16);
      for (int i = 0; i < M; ++i) {
        const __m512 vt = _mm512_set1_ps(tmp[i * PR + j]);
        acc0[i] = _mm512_fmadd_ps(vt, vb0, acc0[i]);
        acc1[i] = _mm512_fmadd_ps(vt, vb1, acc1[i]);
      }
    }
    for (int i = 0; i < M; ++i) _mm512_storeu_ps(yr[i] + n, acc0[i]), _mm512_storeu_ps(yr[i] + n + 16, acc1[i]);
  }
  for (; n + 16 <= width; n += 16) {
    __m512 acc[M];
    for (int i = 0; i < M; ++i) acc[i] = _mm512_loadu_ps(yr[i] + n);
    for (int64_t j : js) {
      const __m512 vb = _mm512_loadu_ps(bo + j * N + n);
      for (int i = 0; i < M; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(tmp[i * PR + j]), vb, acc[i]);
    }
    for (int i = 0; i < M; ++i) _mm512_storeu_ps(yr[i] + n, acc[i]);
  }
  if (n < width) expand_tile<M>(b, ys, rows, N, PR, tmp, js, offset + n, width - n);
}

// Rows [0, M) of `rows` (all under one adapter): y[row] += (x[row] @ A^T) @ B, part p's rows of B only in its
// columns, and only the rows of B whose intermediate is non-zero for some row of the tile.
template <int M>
void lora_tile(const float* xs, const float* a, const float* b, float* ys, const int64_t* rows, int64_t K,
               int64_t N, int64_t PR, const std::vector<int64_t>& part_widths, float* tmp, std::vector<int64_t>& js) {
  shrink_tile<M>(xs, a, rows, K, PR, tmp);
  const int64_t R = PR / static_cast<int64_t>(part_widths.size());
  int64_t offset = 0;
  for (size_t p = 0; p < part_widths.size(); ++p) {
    js.clear();
    for (int64_t j = static_cast<int64_t>(p) * R; j < static_cast<int64_t>(p + 1) * R; ++j) {
      bool any = false;  // a rank padded to --max-lora-rank, or a part the adapter does not target: all zero
      for (int i = 0; i < M; ++i) any = any || tmp[i * PR + j] != 0.0f;
      if (any) js.push_back(j);
    }
    if (!js.empty() && lora_avx512()) {
      expand_tile_avx512<M>(b, ys, rows, N, PR, tmp, js, offset, part_widths[p]);
    } else if (!js.empty()) {
      expand_tile<M>(b, ys, rows, N, PR, tmp, js, offset, part_widths[p]);
    }
    offset += part_widths[p];
  }
}

// A step's rows grouped by adapter (a counting sort), then tiles of up to kRowsPerTile rows of one adapter: what
// lora_add_ runs, and the decode region's share of it (every slot in [-1, L): checked by the caller).
struct LoraTiles {
  std::vector<int64_t> count, order;               // count[s] .. count[s + 1]: slot s's rows in order
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (slot, first index into order)
};

LoraTiles lora_tiles(const int64_t* slots, int64_t T, int64_t L) {
  LoraTiles out;
  out.count.assign(L + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] >= 0) ++out.count[slots[t] + 1];
  }
  for (int64_t s = 0; s < L; ++s) out.count[s + 1] += out.count[s];
  out.order.resize(out.count[L]);
  std::vector<int64_t> next(out.count.begin(), out.count.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] >= 0) out.order[next[slots[t]]++] = t;
  }
  for (int64_t s = 0; s < L; ++s) {
    for (int64_t i = out.count[s]; i < out.count[s + 1]; i += kRowsPerTile) out.tiles.emplace_back(s, i);
  }
  return out;
}

// Tiles [i0, i1): each its rows' y += (x @ A_s^T) @ B_s; a tile writes only its own rows of y.
void run_tiles(const LoraTiles& t, int64_t i0, int64_t i1, const float* xs, const float* as, const float* bs,
               float* ys, int64_t K, int64_t N, int64_t PR, const std::vector<int64_t>& part_widths) {
  std::vector<float> tmp(kRowsPerTile * PR);
  std::vector<int64_t> js;
  js.reserve(PR);
  for (int64_t i = i0; i < i1; ++i) {
    const auto [s, first] = t.tiles[i];
    const float* a = as + s * PR * K;
    const float* b = bs + s * PR * N;
    const int64_t* rows = t.order.data() + first;
    switch (std::min(kRowsPerTile, t.count[s + 1] - first)) {
      case 4: lora_tile<4>(xs, a, b, ys, rows, K, N, PR, part_widths, tmp.data(), js); break;
      case 3: lora_tile<3>(xs, a, b, ys, rows, K, N, PR, part_widths, tmp.data(), js); break;
      case 2: lora_tile<2>(xs, a, b, ys, rows, K, N, PR, part_widths, tmp.data(), js); break;
      default: lora_tile<1>(xs, a, b, ys, rows, K, N, PR, part_widths, tmp.data(), js); break;
    }
  }
}

void lora_add_(at::Tensor& y, const at::Tensor& x_in, const at::Tensor& lora_a, const at::Tensor& lora_b,
               const at::Tensor& row_slots, at::IntArrayRef part_widths_in) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, "tpserve lora_add_: x must be a "
              "float32 (T, K) CPU tensor");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.is_contiguous() && y.size(0) == x.size(0),
              "tpserve lora_add_: y must be a contiguous float32 (T, N) tensor with x's rows");
  TORCH_CHECK(lora_a.is_contiguous() && lora_b.is_contiguous() && lora_a.scalar_type() == at::kFloat &&
                  lora_b.scalar_type() == at::kFloat && lora_a.dim() == 3 && lora_b.dim() == 3,
              "tpserve lora_add_: lora_a (L, PR, K) and lora_b (L, PR, N) must be contiguous float32");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), L = lora_a.size(0), PR = lora_a.size(1);
  TORCH_CHECK(lora_a.size(2) == K && lora_b.size(0) == L && lora_b.size(1) == PR && lora_b.size(2) == N,
              "tpserve lora_add_: lora_a ", lora_a.sizes(), " and lora_b ", lora_b.sizes(), " do not fit x ",
              x.sizes(), " and y ", y.sizes());
  std::vector<int64_t> part_widths(part_widths_in.begin(), part_widths_in.end());
  if (part_widths.empty()) part_widths.push_back(N);  // one part: the whole output
  int64_t width_sum = 0;
  for (int64_t w : part_widths) width_sum += w;
  TORCH_CHECK(!part_widths.empty() && width_sum == N && PR % static_cast<int64_t>(part_widths.size()) == 0,
              "tpserve lora_add_: part_widths ", part_widths_in, " must sum to N=", N, " and divide PR=", PR);
  TORCH_CHECK(row_slots.scalar_type() == at::kLong && row_slots.is_contiguous() && row_slots.numel() == T,
              "tpserve lora_add_: row_slots must be a contiguous int64 (T,) tensor");
  const int64_t* slots = row_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < L, "tpserve lora_add_: row ", t, " has slot index ", slots[t],
                " outside [-1, ", L, ")");
  }
  const LoraTiles tiles = lora_tiles(slots, T, L);
  const float* xs = x.data_ptr<float>();
  const float* as = lora_a.data_ptr<float>();
  const float* bs = lora_b.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t num_tiles = static_cast<int64_t>(tiles.tiles.size());
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kRowsPerTile * PR * (K + N)));
  at::parallel_for(0, num_tiles, grain, [&](int64_t i0, int64_t i1) {
    run_tiles(tiles, i0, i1, xs, as, bs, ys, K, N, PR, part_widths);
  });
}

}  // namespace

namespace tpserve {

void lora_add_share(const float* x, int64_t T, int64_t K, float* y, int64_t N, const LoraSlots& w,
                    const int64_t* row_slots, int64_t tid, int64_t team) {
  const LoraTiles tiles = lora_tiles(row_slots, T, w.L);
  const int64_t num_tiles = static_cast<int64_t>(tiles.tiles.size());
  const int64_t per = num_tiles / team, extra = num_tiles % team;
  const int64_t i0 = tid * per + std::min(tid, extra), i1 = i0 + per + (tid < extra ? 1 : 0);
  if (i0 < i1) run_tiles(tiles, i0, i1, x, w.a, w.b, y, K, N, w.PR, w.part_widths);
}

}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor row_slots, "
        "int[] part_widths) -> ()");
  m.def("lora_use_avx512(bool enabled) -> bool", &lora_use_avx512);
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) { m.impl("lora_add_", &lora_add_); }
