// A Llama decode step in one OpenMP parallel region (cpu_decode_region.cpp), one rank's or a tensor-parallel rank's
// (its all-reduces inside), for stacks whose projections are float32, 16-bit float, int8, fp8, group-wise 8-bit or
// int4, on a float32 or 8-bit KV cache, with or without LoRA adapter rows. DecodeLayers (cpu_decode_block.cpp) gathers the
// pointers once a layer and calls decode_region where a step qualifies.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lora_share.h"
#include "shm_collective.h"

namespace tpserve {

// One projection, y (T, N) = x (T, K) @ W^T [+ bias], in one of the formats the region reads:
//   kInt4Tiles: codes (N, K / 2) uint8 in the int4 tile layout (cpu_linear_int4_tiles.cpp), scale its
//     scale_offset (N / 16, K / G, 2, 16) float32;
//   kInt4Rows: codes (N, K / 2) uint8 in the row-major int4 layout (cpu_linear_int4.cpp), scale its scale_offset
//     (N, K / G, 2) float32: CPUs without AMX-INT8, through linear_int4's AVX512-VNNI path (up to 4 rows of x);
//   kInt8: codes (N, K) int8, scale (N,) float32 (cpu_linear.cpp's weight-only int8);
//   kFp8: weight (N, K) e4m3 bytes, scale (N, K / G) float32 (cpu_linear_fp8.cpp; up to 8 rows of x);
//   kW8: codes (N, K) uint8, scale its scale_offset (N, K / G, 2) float32 (cpu_linear_w8.cpp: group-wise 8-bit
//     GPTQ and W8A16 checkpoints; up to 64 rows of x, AVX-512);
//   kFloat32: weight (N, K) float32, no scale;
//   kBf16, kF16: weight (N, K) bfloat16 or float16, no scale, widened as it is read (cpu_linear.cpp's linear_w16:
//     a checkpoint's 16-bit layers served with float32 activations, worker/layers_w16.py).
struct RegionWeight {
  enum Kind { kInt4Tiles, kInt4Rows, kInt8, kFp8, kW8, kFloat32, kBf16, kF16 } kind;
  const void* weight;
  const float* scale;
  const float* bias;  // (N,) float32 or null
  int64_t N, K, G;    // G: int4's, fp8's and w8's group size
};

// One decoder layer: pointers into tensors that its caller keeps alive.
struct RegionLayer {
  const float* norm1;  // (hidden,) input_layernorm
  float eps1;
  RegionWeight qkv;    // N = (H + 2 KVH) d, its bias q/k/v's (Qwen2) or null
  RegionWeight o;      // bias: o_proj's, added as the op path adds it
  const float* norm2;  // (hidden,) post_attention_layernorm
  float eps2;
  RegionWeight gate_up;  // N = 2 intermediate, [gate | up]
  RegionWeight down;   // bias: down_proj's
  int64_t num_heads, num_kv_heads;
  const float* q_norm;      // (d,) QK-norm's weights (Qwen3), or null: none
  const float* k_norm;
  float qk_norm_eps;
  float scale;              // the attention's q . k scale
  int64_t sliding_window;   // 0: none
  // --enable-lora: each projection's adapter slots (DecodeLayers.add_lora), added after its GEMM on a step with
  // adapter rows; o's and down's row-parallel bias then after them, as the op path adds it.
  bool lora = false;
  LoraSlots qkv_lora, o_lora, gate_up_lora, down_lora;
};

// One step: T decode rows (query rows of S sequences, query_start_loc (S + 1,)), caches (num_blocks, block_size,
// KVH, d) per layer: float32, or 8-bit codes with their bfloat16 scale pools (num_blocks, KVH, block_size) and
// float32 key offset (KVH, d) (worker/kv_quant.py).
struct RegionStep {
  enum CacheKind { kFloat32, kInt8, kFp8 } cache;
  const float* h;  // (T, hidden) in
  float* out;      // (T, hidden) out
  int64_t T, hidden, d;
  const float* cos;  // (T, d)
  const float* sin;
  std::vector<void*> k_caches, v_caches;
  std::vector<void*> k_scales, v_scales;     // 8-bit: per layer
  std::vector<const float*> k_offsets;       // 8-bit: per layer
  int64_t block_size;
  const int64_t* slot_mapping;  // (T,)
  const int64_t* block_tables;  // (S, max_blocks)
  int64_t max_blocks;
  const int64_t* query_start_loc;
  const int64_t* context_lens;
  int64_t S;
  // Tensor parallelism (one host): the group whose shared-memory all-reduce sums o's and the MLP's partial
  // products, each followed by its row-parallel bias (added once, after the sum, as the module path does), and the
  // number of the step's first collective (2 a layer: o, then the MLP's). Null at one rank.
  const ShmGroup* group = nullptr;
  int64_t first_seq = 0;
  // A step with adapter rows: each row's slot index, (T,) int64 in [-1, L) (-1: the base model); null: none.
  const int64_t* lora_row_slots = nullptr;
};

// Whether the region computes T rows of x with these layers exactly as their ops do: int4 tiles at any T on AMX
// (up to 16 rows on VNNI alone: tpserve_int4_tiles::run_rows_take),
// row-major int4 where linear_int4 takes its VNNI path, float32, int8 and fp8 where their ops take the streamed
// GEMV in one pass (tpserve::streamed_gemv_takes, fp8_rows_take).
bool decode_region_takes_rows(const std::vector<RegionLayer>& layers, int64_t T);

// The step through every layer, with at::get_num_threads() threads: bit for bit what the op path
// (attention_block, mlp_block, the residual adds; with a group, each half's all-reduce and bias between them)
// computes. Returns "" or, with a group, the collective's error (the step's results are then undefined).
std::string decode_region(const std::vector<RegionLayer>& layers, const RegionStep& step);

// Whether DecodeLayers takes the region where a step qualifies (default true; use_decode_region(False): the
// ops, for tests and A/B runs).
bool decode_region_enabled();

}  // namespace tpserve
