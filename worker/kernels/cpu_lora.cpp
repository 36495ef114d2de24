// Batched LoRA for a step whose rows use different adapters: punica's BGMV (Chen et al. 2023,
// arXiv:2310.18547) on the CPU, every row's shrink and expand in one call per projection.
//
//   y[t] += (x[t] @ A_s) @ B_s      for every row t whose adapter s = row_slots[t] >= 0
//
// with the layer's slot pool stacked as A (L, K, P*R) and B (L, P*R, N) (worker/layers/lora.py:
// A and B transposed from peft's, the scaling already in B). Both halves run as axpy loops over
// contiguous rows of A and B, which the compiler vectorises without reassociating a sum: the
// shrink accumulates x[t, k] * A_s[k, :] into the row's (P*R,) intermediate, the expand
// tmp[j] * B_s[j, :] into y[t, :]. A zero intermediate (a rank padded to --max-lora-rank, a part
// the adapter does not target) skips its row of B. Rows of no adapter (-1) are untouched, so a
// step mixing base rows and 8 adapters costs one call per projection, not one per adapter.
//
// Why not torch ops: the module path's per-adapter index_select / mm / mm / index_add_ is four
// dispatches per adapter per projection; at decode sizes (a few rows, r = 16) the dispatch is most
// of the cost. Float32 only, like the decode block that calls it (cpu_decode_block.cpp).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

void lora_add_(at::Tensor& y, const at::Tensor& x_in, const at::Tensor& lora_a, const at::Tensor& lora_b,
               const at::Tensor& row_slots) {
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
  TORCH_CHECK(row_slots.scalar_type() == at::kLong && row_slots.is_contiguous() && row_slots.numel() == T,
              "tpserve lora_add_: row_slots must be a contiguous int64 (T,) tensor");
  const int64_t* slots = row_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < L, "tpserve lora_add_: row ", t, " has slot index ", slots[t],
                " outside [-1, ", L, ")");
  }
  const float* xs = x.data_ptr<float>();
  const float* as = lora_a.data_ptr<float>();
  const float* bs = lora_b.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, PR * (K + N)));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp_buffer(PR);
    float* __restrict tmp = tmp_buffer.data();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s = slots[t];
      if (s < 0) continue;
      const float* __restrict xt = xs + t * K;
      const float* __restrict a = as + s * K * PR;
      const float* __restrict b = bs + s * PR * N;
      float* __restrict yt = ys + t * N;
      for (int64_t j = 0; j < PR; ++j) tmp[j] = 0.0f;
      for (int64_t k = 0; k < K; ++k) {  // shrink: tmp += x[t, k] * A_s[k, :]
        const float xv = xt[k];
        const float* __restrict ak = a + k * PR;
        for (int64_t j = 0; j < PR; ++j) tmp[j] += xv * ak[j];
      }
      for (int64_t j = 0; j < PR; ++j) {  // expand: y[t] += tmp[j] * B_s[j, :]
        const float tv = tmp[j];
        if (tv == 0.0f) continue;  // a padded rank or an untargeted part: its row of B is zero
        const float* __restrict bj = b + j * N;
        for (int64_t n = 0; n < N; ++n) yt[n] += tv * bj[n];
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor row_slots) -> ()");
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) { m.impl("lora_add_", &lora_add_); }
