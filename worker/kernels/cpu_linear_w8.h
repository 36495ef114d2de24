// linear_w8's decode path (cpu_linear_w8.cpp: group-wise 8-bit codes, a scale and an offset per group) for the
// decode region (cpu_decode_region.cpp), which calls it on each thread's share of W's rows.
#pragma once

#include <cstdint>

namespace tpserve_w8 {

// Whether linear_w8 computes M rows of x on its AVX-512 decode path (passes of 4 rows, up to 64), which
// region_rows reproduces bit for bit.
bool region_takes(int64_t M);

// y's columns [n0, n1) of x (M, K) @ W^T [+ bias]: W's codes qweight (N, K) uint8, scale_offset (N, K / G, 2)
// float32 (w = s * q + o); x's group sums computed here, in linear_w8's order.
void region_rows(const float* x, int64_t M, int64_t K, int64_t N, int64_t G, const uint8_t* qweight,
                 const float* scale_offset, const float* bias, float* y, int64_t n0, int64_t n1);

}  // namespace tpserve_w8
