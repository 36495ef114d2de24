// The int4 layout's checks and its dequantization to float32 (prefill-sized products, tests), for
// cpu_linear_int4.cpp: the layout is described there.
#include "cpu_linear_int4.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

namespace tpserve_int4 {

constexpr int64_t kCodeBlock = 32;  // columns per 16-byte block of codes

void check(const at::Tensor& qweight, const at::Tensor& scale_offset, int64_t K) {
  TORCH_CHECK(qweight.device().is_cpu() && scale_offset.device().is_cpu(), "tpserve int4: tensors must be on the CPU");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "tpserve int4: qweight must be a contiguous uint8 (N, K / 2) tensor");
  TORCH_CHECK(scale_offset.scalar_type() == at::kFloat && scale_offset.dim() == 3 && scale_offset.size(2) == 2 &&
                  scale_offset.is_contiguous() && scale_offset.size(0) == qweight.size(0),
              "tpserve int4: scale_offset must be a contiguous float32 (N, K / G, 2) tensor");
  TORCH_CHECK(K % kCodeBlock == 0 && qweight.size(1) * 2 == K, "tpserve int4: K=", K,
              " must be a multiple of 32 and qweight must have K / 2 columns, got ", qweight.size(1));
  const int64_t groups = scale_offset.size(1);
  TORCH_CHECK(groups > 0 && K % groups == 0 && (K / groups) % kCodeBlock == 0, "tpserve int4: ", groups,
              " groups do not split K=", K, " into multiples of 32 columns");
}

// W as float32 (N, K): w = s * q + o, rows split between the threads.
at::Tensor dequantize_int4(const at::Tensor& qweight, const at::Tensor& scale_offset) {
  if (scale_offset.dim() == 4) return tpserve_int4_tiles::dequantize_op(qweight, scale_offset);  // tile layout
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  check(qweight, scale_offset, K);
  const int64_t groups = scale_offset.size(1), G = K / groups;
  at::Tensor w = at::empty({N, K}, scale_offset.options());
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const float* sp = scale_offset.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* q = qp + n * (K / 2);
      float* out = wp + n * K;
      for (int64_t k0 = 0; k0 < K; k0 += kCodeBlock) {  // a block lies within one group (G % kCodeBlock == 0)
        const float* so = sp + (n * groups + k0 / G) * 2;
        const float scale = so[0], offset = so[1];
        const uint8_t* bytes = q + k0 / 2;
        for (int64_t j = 0; j < 16; ++j) {
          out[k0 + j] = scale * static_cast<float>(bytes[j] & 0x0F) + offset;
          out[k0 + 16 + j] = scale * static_cast<float>(bytes[j] >> 4) + offset;
        }
      }
    }
  });
  return w;
}

}  // namespace tpserve_int4
