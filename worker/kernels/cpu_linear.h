// What the float32, int8, 16-bit float (cpu_linear.cpp) and fp8 (cpu_linear_fp8.cpp) linear layers give callers that split W's
// rows among their own threads (cpu_decode_region.cpp): the streamed GEMV of a decode step's few rows of x.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <functional>

namespace tpserve {

// Whether linear_f32 / linear_int8 take the streamed GEMV for M rows of x (AVX-512 allowed, M <= 8): then
// streamed_gemv_rows computes exactly what they compute.
bool streamed_gemv_takes(int64_t M);

// y's columns [n0, n1) of y (M, N) = x (M, K) @ W^T [* scale] [+ bias] for M rows of x that streamed_gemv_takes:
// W float32 (w_f32) or int8 (w_i8, with one float32 scale per row). Each of y's values is one dot product
// summed in one fixed order, so any split of [0, N) gives the op's bits.
void streamed_gemv_rows(const float* x, int64_t M, int64_t K, int64_t N, const float* w_f32, const int8_t* w_i8,
                        const float* scale, const float* bias, float* y, int64_t n0, int64_t n1);

// The same for a bfloat16 (bfloat16 true) or float16 W (N, K), widened as it is read: linear_w16's bits, which are
// linear_f32's on W's float32 copy.
void streamed_gemv_rows16(const float* x, int64_t M, int64_t K, int64_t N, const void* w, bool bfloat16,
                          const float* bias, float* y, int64_t n0, int64_t n1);

// cpu_linear_fp8.cpp's linear_fp8 likewise: whether it takes its streamed path in one pass for M rows of x with
// groups of G columns (M <= 8, G % 16 == 0, AVX-512), and y's columns [n0, n1) of it (weight (N, K) e4m3 bytes,
// scale (N, K / G) float32).
bool fp8_rows_take(int64_t M, int64_t G);
void fp8_rows(const float* x, int64_t M, int64_t K, int64_t N, int64_t G, const uint8_t* weight, const float* scale,
              const float* bias, float* y, int64_t n0, int64_t n1);

// y (M, N) = x (M, K) @ W^T [+ bias (N,)] through linear_f32's tiles (4 rows of W against 6 rows of x at a time),
// W's row n given as float32 by row(n, buffer), buffer K floats of the calling thread's own (a row widened or
// dequantized there stays in L1 while every row of x meets it): another format's rows at float32 arithmetic, for a
// product of more rows than its own decode paths take (cpu_linear_int4.cpp on a CPU without AMX-INT8). x contiguous
// float32 (M, K), bias contiguous float32 or none.
at::Tensor tiles_from_rows(const at::Tensor& x, int64_t N, const c10::optional<at::Tensor>& bias,
                           const std::function<const float*(int64_t, float*)>& row);

}  // namespace tpserve
