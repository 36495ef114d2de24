// What cpu_linear_int4.cpp calls in its neighbours: the layout's checks and dequantization
// (cpu_dequantize_int4.cpp) and the AMX path (cpu_linear_int4_amx.cpp). The layout: cpu_linear_int4.cpp.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace tpserve_int4 {

// TORCH_CHECKs qweight (N, K / 2) uint8 and scale_offset (N, K / G, 2) float32, contiguous CPU tensors.
void check(const at::Tensor& qweight, const at::Tensor& scale_offset, int64_t K);

// W as float32 (N, K): w = s * q + o.
at::Tensor dequantize_int4(const at::Tensor& qweight, const at::Tensor& scale_offset);

}  // namespace tpserve_int4

namespace tpserve_int4_amx {

// Whether this CPU has AMX-INT8 and the kernel let this process use the tile registers
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA), asked once).
bool amx_available();

// y (M, N) = x (M, K) @ W^T + bias over the int4 layout of cpu_linear_int4.cpp, W read once per 5 rows of x.
// Needs amx_available(), N % 16 == 0, K % 128 == 0 and G % 128 == 0; y's row stride is N.
void linear(const float* x, int64_t M, int64_t K, int64_t N, int64_t G, const uint8_t* qweight,
            const float* scale_offset, const float* bias, float* y);

}  // namespace tpserve_int4_amx
