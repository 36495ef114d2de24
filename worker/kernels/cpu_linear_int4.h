// What cpu_linear_int4.cpp calls in its neighbours: the layout's checks and dequantization
// (cpu_dequantize_int4.cpp) and the AMX path (cpu_linear_int4_amx.cpp). The layout: cpu_linear_int4.cpp.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tpserve_int4 {

// TORCH_CHECKs qweight (N, K / 2) uint8 and scale_offset (N, K / G, 2) float32, contiguous CPU tensors.
void check(const at::Tensor& qweight, const at::Tensor& scale_offset, int64_t K);

// W as float32 (N, K): w = s * q + o.
at::Tensor dequantize_int4(const at::Tensor& qweight, const at::Tensor& scale_offset);

// linear_int4's AVX512-VNNI path over the row-major layout, for a caller that splits W's rows among its own
// threads (cpu_decode_region.cpp): vnni_rows_take says whether linear_int4 takes it for M rows of x (M <= 4, no
// AMX path, groups of a multiple of 128); vnni_prepare cuts x (M, K) into its planes, units and group sums;
// vnni_rows then writes y's columns [n0, n1) of the M rows (row stride N). Each of y's values is one row's
// sums in a fixed order, so any split gives linear_int4's bits.
// Whether this CPU has AVX512-VNNI (with AVX512-BW); whether use_amx_int4 left the AMX paths on (they also need
// tpserve_int4_amx::amx_available()).
bool cpu_has_vnni();
bool amx_allowed();

bool vnni_rows_take(int64_t M, int64_t K, int64_t N, int64_t G);
void vnni_prepare(const float* x, int64_t M, int64_t K, int64_t G, std::vector<int8_t>& planes,
                  std::vector<float>& units, std::vector<float>& xsum);
void vnni_rows(int64_t M, int64_t n0, int64_t n1, int64_t K, int64_t N, int64_t G, const uint8_t* qweight,
               const float* scale_offset, const int8_t* planes, const float* units, const float* xsum,
               const float* bias, float* y);

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

namespace tpserve_int4_tiles {

// y (M, N) = x (M, K) @ W^T + bias over the tile layout of cpu_linear_int4_tiles.cpp (qweight (N, K / 2) uint8
// in 1,024-byte blocks of 16 rows x 128 columns, scale_offset (N / 16, K / G, 2, 16) float32), W read once per
// 10 rows of x, at any M: on AMX's tile unit, else (no AMX, or use_amx_int4(False)) in AVX512-VNNI instructions,
// the same bits. Needs supported(), N % 16 == 0, K % 128 == 0 and G % 128 == 0.
void linear(const float* x, int64_t M, int64_t K, int64_t N, int64_t G, const uint8_t* qweight,
            const float* scale_offset, const float* bias, float* y);

// Whether this CPU runs the tile layout: AMX-INT8 or AVX512-VNNI.
bool supported();

// The pieces of linear, for a caller that splits W's blocks among its own threads (cpu_decode_region.cpp):
// prepare_rows cuts R <= 10 rows of x (R, K) into their planes a (plane_bytes(R, K) bytes), units (R, K / 128)
// and group sums xsum (R, K / G); run_rows then writes y's columns [16 t0, 16 t1) of those R rows (row stride
// N) from blocks of rows [t0, t1) of W. Each block's sums run in one fixed order, so any split gives the
// same bits as linear.
size_t plane_bytes(int64_t R, int64_t K);
void prepare_rows(const float* x, int64_t R, int64_t K, int64_t G, int8_t* a, float* units, float* xsum);
void run_rows(int64_t R, int64_t t0, int64_t t1, int64_t K, int64_t N, int64_t G, const uint8_t* qweight,
              const float* scale_offset, const int8_t* a, const float* units, const float* xsum, const float* bias,
              float* y);
constexpr int64_t kMaxRowsPerPass = 10;  // R of prepare_rows and run_rows
// Whether linear computes M rows of x by prepare_rows and run_rows (AMX: at any M; VNNI: up to 16 rows, beyond
// which it multiplies dequantized rows in float32), so that a caller's split gives its bits.
bool run_rows_take(int64_t M);

// W as float32 (N, K), row-major, from the tile layout.
void dequantize(const uint8_t* qweight, const float* scale_offset, int64_t N, int64_t K, int64_t G, float* w);

// The ops' bodies for the tile layout (scale_offset of 4 dimensions), shapes checked: linear_int4 (the tiles at
// every row count: cpu_linear_int4_tiles.cpp, "Prefill") and dequantize_int4.
at::Tensor linear_op(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale_offset,
                     const c10::optional<at::Tensor>& bias);
at::Tensor dequantize_op(const at::Tensor& qweight, const at::Tensor& scale_offset);

}  // namespace tpserve_int4_tiles
