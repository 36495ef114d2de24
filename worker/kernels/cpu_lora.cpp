// Batched LoRA for a step whose rows use different adapters: punica's BGMV (Chen et al. 2023,
// arXiv:2310.18547) on the CPU, every row's shrink and expand in one call per projection.
//
//   y[t] += (x[t] @ A_s) @ B_s      for every row t whose adapter s = row_slots[t] >= 0
//
// with the layer's slot pool stacked as A (L, K, P*R) and B (L, P*R, N) (worker/layers/lora.py:
// A and B transposed from peft's, the scaling already in B). Both halves run as axpy loops over
// contiguous rows of A and B, which the compiler vectorises without reassociating a sum: the
// shrink accumulates x[t, k] * A_s[k, :] into the row's (P*R,) intermediate, the expand
// tmp[j] * B_s[j, :] into y[t, :]. The rows are grouped by adapter (a counting sort, once per call)
// into tiles of up to 4 rows that share each read of A_s and B_s (punica's SGMV segments). A fused
// layer's B is block diagonal (part p's R rows reach only its part_widths[p] columns: q, k, v or
// gate, up), so the expand reads only each part's block. A zero intermediate (a rank padded to
// --max-lora-rank, a part the adapter does not target) skips its row of B. Rows of no adapter (-1)
// are untouched, so a step mixing base rows and 8 adapters costs one call per projection.
//
// Why not torch ops: the module path's per-adapter index_select / mm / mm / index_add_ is four
// dispatches per adapter per projection; at decode sizes (a few rows, r = 16) the dispatch is most
// of the cost. Float32 only, like the decode block that calls it (cpu_decode_block.cpp).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kRowsPerTile = 4;  // rows of one adapter that share each read of its A and B

// Rows [0, m) of `rows` (all under one adapter): y[row] += (x[row] @ A) @ B, B's part p only in its columns.
void lora_tile(const float* xs, const float* a, const float* b, float* ys, const int64_t* rows, int64_t m, int64_t K,
               int64_t N, int64_t PR, const std::vector<int64_t>& part_widths, float* tmp) {
  const int64_t R = PR / static_cast<int64_t>(part_widths.size());
  for (int64_t i = 0; i < m * PR; ++i) tmp[i] = 0.0f;
  for (int64_t k = 0; k < K; ++k) {  // shrink: tmp_i += x[row_i, k] * A[k, :], A's row read once for the tile
    const float* __restrict ak = a + k * PR;
    for (int64_t i = 0; i < m; ++i) {
      const float xv = xs[rows[i] * K + k];
      float* __restrict ti = tmp + i * PR;
      for (int64_t j = 0; j < PR; ++j) ti[j] += xv * ak[j];
    }
  }
  int64_t offset = 0;
  for (size_t p = 0; p < part_widths.size(); ++p) {  // expand: part p's R rows of B reach only its columns
    const int64_t width = part_widths[p];
    for (int64_t j = static_cast<int64_t>(p) * R; j < static_cast<int64_t>(p + 1) * R; ++j) {
      const float* __restrict bj = b + j * N + offset;
      for (int64_t i = 0; i < m; ++i) {
        const float tv = tmp[i * PR + j];
        if (tv == 0.0f) continue;  // a rank padded to --max-lora-rank, or a part the adapter does not target
        float* __restrict yi = ys + rows[i] * N + offset;
        for (int64_t n = 0; n < width; ++n) yi[n] += tv * bj[n];
      }
    }
    offset += width;
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
              "tpserve lora_add_: lora_a (L, K, PR) and lora_b (L, PR, N) must be contiguous float32");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), L = lora_a.size(0), PR = lora_a.size(2);
  TORCH_CHECK(lora_a.size(1) == K && lora_b.size(0) == L && lora_b.size(1) == PR && lora_b.size(2) == N,
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
  // The rows grouped by adapter (a counting sort), then tiles of up to kRowsPerTile rows of one adapter.
  std::vector<int64_t> count(L + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < L, "tpserve lora_add_: row ", t, " has slot index ", slots[t],
                " outside [-1, ", L, ")");
    if (slots[t] >= 0) ++count[slots[t] + 1];
  }
  for (int64_t s = 0; s < L; ++s) count[s + 1] += count[s];
  std::vector<int64_t> order(count[L]), next(count.begin(), count.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] >= 0) order[next[slots[t]]++] = t;
  }
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (slot, first index into order)
  for (int64_t s = 0; s < L; ++s) {
    for (int64_t i = count[s]; i < count[s + 1]; i += kRowsPerTile) tiles.emplace_back(s, i);
  }
  const float* xs = x.data_ptr<float>();
  const float* as = lora_a.data_ptr<float>();
  const float* bs = lora_b.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kRowsPerTile * PR * (K + N)));
  at::parallel_for(0, num_tiles, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> tmp(kRowsPerTile * PR);
    for (int64_t i = i0; i < i1; ++i) {
      const auto [s, first] = tiles[i];
      const int64_t m = std::min(kRowsPerTile, count[s + 1] - first);
      lora_tile(xs, as + s * K * PR, bs + s * PR * N, ys, order.data() + first, m, K, N, PR, part_widths,
                tmp.data());
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor row_slots, "
        "int[] part_widths) -> ()");
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) { m.impl("lora_add_", &lora_add_); }
