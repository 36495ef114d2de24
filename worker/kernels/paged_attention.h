// The paged attention kernel's work items, for callers that split a step's work among threads themselves:
// cpu_attention.cpp's paged_attention op runs items [0, S * KVH) under at::parallel_for; the decode step's
// single parallel region (cpu_decode_region.cpp) gives each thread its own range. An item is one
// (sequence, KV head) pair and writes only its query heads' rows of `out`, so any split gives the same bits.
#pragma once

#include <cstdint>

namespace tpserve {

// One call's constants (cpu_attention.cpp states the maths). T: the cache's element type (float; int8_t or
// an 8-bit float for an 8-bit cache, with k_scale, v_scale, k_offset).
template <typename T>
struct PagedCall {
  const float* q;            // (R, H, d) query rows: row r, head h at q + r * q_row_stride + h * q_head_stride
  int64_t q_row_stride, q_head_stride;
  const T* k_cache;          // (num_blocks, block_size, KVH, d), contiguous
  const T* v_cache;
  int64_t block_size, KVH, H, d;
  const int64_t* block_tables;  // (S, max_blocks)
  int64_t max_blocks;
  const int64_t* query_start_loc;  // (S + 1,): sequence s owns rows [query_start_loc[s], query_start_loc[s + 1])
  const int64_t* context_lens;     // (S,) positions, this step's rows included
  int64_t S;
  float scale;
  const uint16_t* k_scale = nullptr;  // an 8-bit cache's bfloat16 scale pools (num_blocks, KVH, block_size)
  const uint16_t* v_scale = nullptr;
  const float* k_offset = nullptr;    // (KVH, d)
  int64_t sliding_window = 0;          // 0: none
  float logit_softcap = 0.0f;          // 0: none
  const float* sinks = nullptr;        // (H,) or none
  float* out;                          // (R, H, d), contiguous
};

// Items [begin, end) of call (item i: sequence i / KVH, KV head i % KVH). Needs a head size the kernel has
// (paged_attention_head_size) and the shapes the op checks; checks nothing itself.
template <typename T>
void paged_attention_items(const PagedCall<T>& call, int64_t begin, int64_t end);

// Whether the kernel has a path for head size d.
bool paged_attention_head_size(int64_t d);

}  // namespace tpserve
