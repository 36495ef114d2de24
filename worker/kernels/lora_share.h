// lora_add_'s work (cpu_lora.cpp: punica's BGMV, rows grouped by adapter into tiles of up to 4) for the decode
// region (cpu_decode_region.cpp), which runs each thread's share of the tiles: the same tiles, so the same bits.
#pragma once

#include <cstdint>
#include <vector>

namespace tpserve {

// A projection's adapter slots: A (L, PR, K) and B (L, PR, N) float32 (worker/layers/lora.py's pools, the scaling in
// B), a fused layer's parts' widths (summing to N; one part: {N}).
struct LoraSlots {
  const float* a = nullptr;
  const float* b = nullptr;
  int64_t L = 0, PR = 0;
  std::vector<int64_t> part_widths;
};

// y (T, N) += (x (T, K) @ A_s^T) @ B_s for the rows whose slot s = row_slots[t] >= 0 (every slot in [-1, L), checked
// by the caller): thread tid's contiguous share of lora_add_'s tiles (team threads); a tile writes only its rows of y.
void lora_add_share(const float* x, int64_t T, int64_t K, float* y, int64_t N, const LoraSlots& w,
                    const int64_t* row_slots, int64_t tid, int64_t team);

}  // namespace tpserve
