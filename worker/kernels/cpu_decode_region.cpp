// A Llama decode step in one OpenMP parallel region, for float32, 16-bit float (bfloat16, float16 widened as read),
// int8, fp8, group-wise 8-bit and int4 stacks on a
// float32 or 8-bit (int8, fp8) KV cache: one rank's whole stack, or a tensor-parallel rank's, its all-reduces
// included.
//
// Why: DecodeLayers' op path (cpu_decode_block.cpp) runs a layer as ten ops, each through the dispatcher,
// each allocating its output, the projections and the attention each forking and joining the OpenMP team.
// On the 95M benchmark model in int4 (30 layers, batch 1, 2 threads) the projections proper took about
// 0.72 ms of a 1.45 ms stack: the second thread spun 44 % of the step (perf) while the first ran that
// glue alone. Here the team is formed once a step and keeps every phase split between its threads, with
// a barrier where a phase needs another's output (six a layer), so the glue either runs on every thread
// at once (the norms, x's planes: cheap, and redundant copies need no barrier) or is gone (dispatch, fork,
// join, allocation).
//
// Per layer, with h the residual stream (each thread its own identical copy):
//   1. x = rms_norm(h) [int4: its planes];             qkv = x W_qkv^T   [W's rows split, 16 at a time]  | barrier
//   2. per (sequence, KV head) item [items split]: [QK-norm and] RoPE on its query heads and key head, its
//      key and value rows into the cache, then paged attention over its context                       | barrier
//   3. [the heads' planes];                            o = heads W_o^T [+ b_o]                           | barrier
//   4. h2 = h + o, x2 = rms_norm(h2) [its planes];     gate_up = x2 W_gu^T                               | barrier
//   5. act = silu(gate) * up [columns split]                                                          | barrier
//      [act's planes];                                 m = act W_down^T [+ b_down]                       | barrier
//   6. h = h2 + m.
// Tensor parallelism (one host, the compiled shared-memory collectives: worker/comm/shm_allreduce.py): o and m are
// this rank's partial products (its heads, its slice of the MLP); after each, a barrier, thread 0 sums them over the
// ranks (shm_all_reduce, cpu_shm.cpp: rank order, the bits of SharedMemoryComm.all_reduce) and adds the row-parallel
// bias, and a second barrier: the layer's halves and ctx.all_reduce of the op path, without the four Python calls
// and two op dispatches a layer between them. A lost peer fails the step with SharedMemoryComm's error.
// LoRA (a step with adapter rows): after each projection a barrier and lora_add_'s tiles split between the threads
// (lora_share.h), then a barrier; o's and down's row-parallel bias after the adapters' sums, as the op path adds it.
// Every value is made by the same function as on the op path (row_math.h, kv_store.h; the int4 tiles' run_rows,
// linear_int4's VNNI rows, cpu_linear.cpp's streamed GEMV and linear_fp8's pass, whose every output is one dot
// product in a fixed order; cpu_attention.cpp's items), each by one thread, so the hidden states and caches equal
// the op path's bit for bit (tests/worker/test_decode_block.py). float32, 16-bit, int8 and fp8 projections take the region
// where their op takes its streamed path in one pass (up to 8 rows of x, AVX-512); int4 tiles at any row count on
// AMX (up to 16 rows on AVX512-VNNI alone, as linear_int4),
// 10 rows a pass; int4's row-major layout where linear_int4 takes its AVX512-VNNI path (up to 4 rows, no AMX);
// group-wise 8-bit where linear_w8 takes its AVX-512 decode passes (up to 64 rows).
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "cpu_linear.h"
#include "kv_codes.h"
#include "kv_store.h"
#include "cpu_linear_int4.h"
#include "cpu_linear_w8.h"
#include "decode_region.h"
#include "paged_attention.h"
#include "row_math.h"

namespace tpserve {

namespace {

std::atomic<bool> allow_region{true};
std::atomic<int64_t> region_steps{0};  // steps run here since the library loaded (tests check the region ran)

// The team's barrier between phases: arrivals counted on one cache line, the phase flipped on another by the last
// arrival; the others spin on it with pause (about 20 us), then yield their core (a thread of the team
// descheduled, more threads than cores), then sleep 50 us at a time (a tensor-parallel peer that is late, or lost
// until the collective's timeout: the waiting threads give their cores up). Why not `omp barrier`: libgomp's
// barrier spins only as long as GOMP_SPINCOUNT says and then sleeps in the kernel, so under OMP_WAIT_POLICY=passive
// (common advice for shared hosts) each of the region's six barriers a layer paid a futex wake-up: the 95M
// model's int4 stack took 1.86 ms instead of 1.19 (benchmarks/README.md, "decode_region_tp.py"). acq_rel on the
// arrival and release/acquire on the phase make every write before the barrier visible after it, as omp
// barrier's flush does.
struct SpinBarrier {
  alignas(64) std::atomic<int> arrived{0};
  alignas(64) std::atomic<unsigned> phase{0};

  void wait(int team) {
    const unsigned ph = phase.load(std::memory_order_relaxed);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) == team - 1) {
      arrived.store(0, std::memory_order_relaxed);
      phase.store(ph + 1, std::memory_order_release);
      return;
    }
    for (int polls = 0; phase.load(std::memory_order_acquire) == ph; ++polls) {
      if (polls < 2048) {
        _mm_pause();
      } else if (polls < 2048 + 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }
};

// [begin, end) of n items for thread tid of team: contiguous, sizes differing by at most one.
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int team) {
  return {n * tid / team, n * (tid + 1) / team};
}

// Activations on 64-byte boundaries, as at::empty gives the ops their inputs and outputs: the GEMVs load 16 floats
// of x at a time for each of up to 8 rows, and a load across two cache lines costs two (fp8 at 8 rows: 5 % of the
// step with std::vector's 16-byte alignment).
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}  // NOLINT: an allocator converts implicitly
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
using Floats = std::vector<float, Aligned64<float>>;

// x (T, K) cut into its planes for an int4 projection, 10 rows a pass (cpu_linear_int4.h), in one thread's buffers.
struct XPlanes {
  std::vector<int8_t> a;
  std::vector<float> units, xsum;
  int64_t passes = 0, a_pass = 0, units_pass = 0, xsum_pass = 0;

  void prepare(const float* x, int64_t T, int64_t K, int64_t G) {
    constexpr int64_t P = tpserve_int4_tiles::kMaxRowsPerPass;
    passes = (T + P - 1) / P;
    a_pass = static_cast<int64_t>(tpserve_int4_tiles::plane_bytes(P, K));
    units_pass = P * (K / 128), xsum_pass = P * (K / G);
    a.resize(static_cast<size_t>(passes * a_pass));
    units.resize(static_cast<size_t>(passes * units_pass));
    xsum.resize(static_cast<size_t>(passes * xsum_pass));
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t R = std::min(P, T - p * P);
      tpserve_int4_tiles::prepare_rows(x + p * P * K, R, K, G, a.data() + p * a_pass, units.data() + p * units_pass,
                                       xsum.data() + p * xsum_pass);
    }
  }

  // y's columns of W's 16-row blocks [t0, t1), every row of x.
  void project(const RegionWeight& w, int64_t T, int64_t t0, int64_t t1, float* y) const {
    constexpr int64_t P = tpserve_int4_tiles::kMaxRowsPerPass;
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t R = std::min(P, T - p * P);
      tpserve_int4_tiles::run_rows(R, t0, t1, w.K, w.N, w.G, static_cast<const uint8_t*>(w.weight), w.scale,
                                   a.data() + p * a_pass, units.data() + p * units_pass, xsum.data() + p * xsum_pass,
                                   w.bias, y + p * P * w.N);
    }
  }
};

// x (T <= 4, K) cut for the row-major int4 layout's VNNI path (cpu_linear_int4.h), in one thread's buffers.
struct VnniPlanes {
  std::vector<int8_t> planes;
  std::vector<float> units, xsum;
};

// One thread's copies: the residual stream, the normed rows, x's planes.
struct Local {
  Floats h, h2, x;
  XPlanes planes;
  VnniPlanes vnni;
};

// y (T, N) = x (T, K) @ W^T [+ bias]: this thread's share of W's rows, 16 at a time (the int4 tiles' blocks), for
// every row of x. int4: x's planes are cut here, by each thread for itself (cheaper than a barrier).
void project_share(const RegionWeight& w, const float* x, int64_t T, Local& local, int tid, int team, float* y) {
  const auto [b0, b1] = share((w.N + 15) / 16, tid, team);
  const int64_t n0 = 16 * b0, n1 = std::min(w.N, 16 * b1);
  if (w.kind == RegionWeight::kInt4Tiles) {
    local.planes.prepare(x, T, w.K, w.G);
    local.planes.project(w, T, b0, b1, y);
  } else if (w.kind == RegionWeight::kInt4Rows) {
    VnniPlanes& v = local.vnni;
    tpserve_int4::vnni_prepare(x, T, w.K, w.G, v.planes, v.units, v.xsum);
    tpserve_int4::vnni_rows(T, n0, n1, w.K, w.N, w.G, static_cast<const uint8_t*>(w.weight), w.scale, v.planes.data(),
                            v.units.data(), v.xsum.data(), w.bias, y);
  } else if (w.kind == RegionWeight::kFp8) {
    fp8_rows(x, T, w.K, w.N, w.G, static_cast<const uint8_t*>(w.weight), w.scale, w.bias, y, n0, n1);
  } else if (w.kind == RegionWeight::kW8) {
    tpserve_w8::region_rows(x, T, w.K, w.N, w.G, static_cast<const uint8_t*>(w.weight), w.scale, w.bias, y, n0, n1);
  } else if (w.kind == RegionWeight::kBf16 || w.kind == RegionWeight::kF16) {
    streamed_gemv_rows16(x, T, w.K, w.N, w.weight, w.kind == RegionWeight::kBf16, w.bias, y, n0, n1);
  } else {
    const bool int8 = w.kind == RegionWeight::kInt8;
    streamed_gemv_rows(x, T, w.K, w.N, int8 ? nullptr : static_cast<const float*>(w.weight),
                       int8 ? static_cast<const int8_t*>(w.weight) : nullptr, w.scale, w.bias, y, n0, n1);
  }
}

// Items [b, e) of phase 2 (sequence item / KVH, KV head item % KVH) for layer li: each row of the sequence gets
// [QK-norm and] RoPE on the KV head's query heads and key head, in place in qkv, as rotary_and_cache does them;
// the key and value rows go into the cache (float32: copied; 8-bit: kv_store.h's codes and scales, the key less
// its offset); then the paged attention of the items writes their heads' rows of `heads`. Stored: the cache's
// element type as written (c10's for e4m3), Read: as the attention kernel reads it (kv_codes.h).
template <typename Stored, typename Read>
void rope_cache_attend(const RegionLayer& L, const RegionStep& step, size_t li, float* qkv, float* heads, int64_t b,
                       int64_t e) {
  const int64_t d = step.d, KVH = L.num_kv_heads, H = L.num_heads, groups = H / KVH, width = L.qkv.N;
  const int64_t bs = step.block_size;
  auto* kc = static_cast<Stored*>(step.k_caches[li]);
  auto* vc = static_cast<Stored*>(step.v_caches[li]);
  constexpr bool codes = !std::is_same_v<Stored, float>;
  auto* ks = static_cast<c10::BFloat16*>(codes ? step.k_scales[li] : nullptr);
  auto* vs = static_cast<c10::BFloat16*>(codes ? step.v_scales[li] : nullptr);
  const float* ko = codes ? step.k_offsets[li] : nullptr;
  for (int64_t item = b; item < e; ++item) {
    const int64_t s = item / KVH, j = item % KVH;
    for (int64_t r = step.query_start_loc[s]; r < step.query_start_loc[s + 1]; ++r) {
      float* row = qkv + r * width;
      const float* c = step.cos + r * d;
      const float* sn = step.sin + r * d;
      for (int64_t g = 0; g < groups; ++g) {
        float* q = row + (j * groups + g) * d;
        if (L.q_norm) rms_norm_row(q, L.q_norm, L.qk_norm_eps, d, q);  // in place, as the op
        rotate_half_head(q, c, sn, d);
      }
      float* key = row + (H + j) * d;
      const float* value = row + (H + KVH + j) * d;
      if (L.k_norm) rms_norm_row(key, L.k_norm, L.qk_norm_eps, d, key);
      rotate_half_head(key, c, sn, d);
      const int64_t slot = step.slot_mapping[r], at = (slot * KVH + j) * d;
      if constexpr (codes) {
        // The position's scale of head j in its block's (KVH, block_size) scales.
        const int64_t scale_at = (slot / bs * KVH + j) * bs + slot % bs;
        store_row(kc + at, ks + scale_at, key, ko + j * d, d);
        store_row(vc + at, vs + scale_at, value, nullptr, d);
      } else {
        std::memcpy(kc + at, key, static_cast<size_t>(d) * sizeof(float));
        std::memcpy(vc + at, value, static_cast<size_t>(d) * sizeof(float));
      }
    }
  }
  const PagedCall<Read> call{qkv, width, d, reinterpret_cast<const Read*>(kc), reinterpret_cast<const Read*>(vc), bs,
                             KVH, H, d, step.block_tables, step.max_blocks, step.query_start_loc, step.context_lens,
                             step.S, L.scale, reinterpret_cast<const uint16_t*>(ks),
                             reinterpret_cast<const uint16_t*>(vs), ko, L.sliding_window, 0.0f, nullptr, heads};
  paged_attention_items(call, b, e);
}

bool takes(const RegionWeight& w, int64_t T) {
  switch (w.kind) {
    case RegionWeight::kInt4Tiles: return tpserve_int4_tiles::run_rows_take(T);
    case RegionWeight::kInt4Rows: return tpserve_int4::vnni_rows_take(T, w.K, w.N, w.G);
    case RegionWeight::kFp8: return fp8_rows_take(T, w.G);
    case RegionWeight::kW8: return tpserve_w8::region_takes(T);
    default: return streamed_gemv_takes(T);
  }
}

}  // namespace

bool decode_region_enabled() { return allow_region.load(std::memory_order_relaxed); }

bool use_decode_region(bool enabled) {
  allow_region.store(enabled);
  return enabled;
}

int64_t decode_region_steps() { return region_steps.load(); }

bool decode_region_takes_rows(const std::vector<RegionLayer>& layers, int64_t T) {
  for (const RegionLayer& L : layers) {
    if (!takes(L.qkv, T) || !takes(L.o, T) || !takes(L.gate_up, T) || !takes(L.down, T)) return false;
  }
  return true;
}

std::string decode_region(const std::vector<RegionLayer>& layers, const RegionStep& step) {
  const int64_t T = step.T, hidden = step.hidden, d = step.d;
  const RegionLayer& first = layers.front();
  const int64_t KVH = first.num_kv_heads;
  // The team's shared outputs: each phase writes them in disjoint parts, the next reads them whole.
  int64_t qkv_width = 0, heads_width = 0, gu_width = 0;
  for (const RegionLayer& L : layers) {
    qkv_width = std::max(qkv_width, L.qkv.N);
    heads_width = std::max(heads_width, L.num_heads * d);
    gu_width = std::max(gu_width, L.gate_up.N);
  }
  Floats qkv(static_cast<size_t>(T * qkv_width)), heads(static_cast<size_t>(T * heads_width)),
      o(static_cast<size_t>(T * hidden)), gate_up(static_cast<size_t>(T * gu_width)),
      act(static_cast<size_t>(T * gu_width / 2)), m(static_cast<size_t>(T * hidden));
  region_steps.fetch_add(1, std::memory_order_relaxed);
  SpinBarrier barrier;
  // Tensor parallelism: thread 0 sums the team's partial o (and m) over the ranks between two barriers, then adds
  // the row-parallel bias, which the projections therefore leave out (RegionWeight copies without it).
  std::string error;  // thread 0's collective's, read by the team after the barrier that follows it
  int64_t seq = step.first_seq;
  // One rank, a step with adapter rows: y's rows + the row-parallel bias after the adapters' sums, each thread its
  // rows (after a barrier: the sums are in).
  auto add_bias = [&](float* y, const float* bias, int team) {
    if (bias == nullptr) return;
    barrier.wait(team);
    const auto [t0, t1] = share(step.T, omp_get_thread_num(), team);
    for (int64_t t = t0; t < t1; ++t) add_row(y + t * step.hidden, bias, step.hidden, y + t * step.hidden);
  };
  auto all_reduce = [&](float* y, const float* bias, int team) {
    barrier.wait(team);
    if (omp_get_thread_num() == 0 && error.empty()) {
      const int64_t n = step.T * step.hidden;
      error = shm_all_reduce(y, n, *step.group, seq++);
      if (error.empty() && bias != nullptr) {
        for (int64_t t = 0; t < step.T; ++t) add_row(y + t * step.hidden, bias, step.hidden, y + t * step.hidden);
      }
    }
  };
  // After a row-parallel projection (o, down) y = x W^T: [+ the adapters' sums] [summed over the ranks] [+ its bias,
  // where the GEMV left it out], then the barrier after which the team reads y (and thread 0's error, if any).
  auto row_parallel_tail = [&](const float* x, const RegionWeight& w, const LoraSlots& adapters, bool bias_after,
                               float* y, int team) {
    if (step.lora_row_slots != nullptr) {
      barrier.wait(team);
      lora_add_share(x, step.T, w.K, y, step.hidden, adapters, step.lora_row_slots, omp_get_thread_num(), team);
    }
    if (step.group != nullptr) {
      all_reduce(y, w.bias, team);
    } else if (bias_after) {
      add_bias(y, w.bias, team);
    }
    barrier.wait(team);
  };
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int team = omp_get_num_threads(), tid = omp_get_thread_num();
    thread_local Local local;
    local.h.assign(step.h, step.h + T * hidden);
    local.h2.resize(static_cast<size_t>(T * hidden));
    local.x.resize(static_cast<size_t>(T * hidden));
    for (size_t li = 0; li < layers.size(); ++li) {
      const RegionLayer& L = layers[li];
      const int64_t H = L.num_heads, groups = H / L.num_kv_heads, width = L.qkv.N;
      RegionWeight o_w = L.o, down_w = L.down;
      // Row-parallel biases after the all-reduce, and after the adapters' sums (the op path's order).
      const bool lora = step.lora_row_slots != nullptr;
      const bool bias_after = step.group != nullptr || lora;
      if (bias_after) o_w.bias = down_w.bias = nullptr;
      // 1. qkv = rms_norm(h) W_qkv^T
      for (int64_t t = 0; t < T; ++t) {
        rms_norm_row(local.h.data() + t * hidden, L.norm1, L.eps1, hidden, local.x.data() + t * hidden);
      }
      project_share(L.qkv, local.x.data(), T, local, tid, team, qkv.data());
      barrier.wait(team);
      if (lora) {  // + the adapters' q, k, v: each thread its tiles of rows
        lora_add_share(local.x.data(), T, L.qkv.K, qkv.data(), L.qkv.N, L.qkv_lora, step.lora_row_slots, tid, team);
        barrier.wait(team);
      }
      // 2. RoPE, the cache write and attention, per (sequence, KV head)
      {
        const auto [b, e] = share(step.S * KVH, tid, team);
        switch (step.cache) {
          case RegionStep::kFloat32:
            rope_cache_attend<float, float>(L, step, li, qkv.data(), heads.data(), b, e);
            break;
          case RegionStep::kInt8:
            rope_cache_attend<int8_t, int8_t>(L, step, li, qkv.data(), heads.data(), b, e);
            break;
          case RegionStep::kFp8:
            rope_cache_attend<c10::Float8_e4m3fn, Fp8E4M3>(L, step, li, qkv.data(), heads.data(), b, e);
            break;
        }
      }
      barrier.wait(team);
      // 3. o = heads W_o^T [+ b_o]
      project_share(o_w, heads.data(), T, local, tid, team, o.data());
      row_parallel_tail(heads.data(), L.o, L.o_lora, bias_after, o.data(), team);
      if (!error.empty()) break;  // every thread leaves at the same point
      // 4. gate_up = rms_norm(h + o) W_gu^T
      for (int64_t t = 0; t < T; ++t) {
        float* h2 = local.h2.data() + t * hidden;
        add_row(local.h.data() + t * hidden, o.data() + t * hidden, hidden, h2);
        rms_norm_row(h2, L.norm2, L.eps2, hidden, local.x.data() + t * hidden);
      }
      project_share(L.gate_up, local.x.data(), T, local, tid, team, gate_up.data());
      barrier.wait(team);
      if (lora) {
        lora_add_share(local.x.data(), T, hidden, gate_up.data(), L.gate_up.N, L.gate_up_lora, step.lora_row_slots,
                       tid, team);
        barrier.wait(team);
      }
      // 5. act = silu(gate) * up, split by columns, 16 at a time (its exponentials are the MLP's costliest
      // elementwise work: 10 us a layer at 8 rows of 1,536 on one thread), then m = act W_down^T [+ b_down]
      {
        const int64_t inter = L.gate_up.N / 2;
        const auto [b0, b1] = share((inter + 15) / 16, tid, team);
        const int64_t c0 = 16 * b0, c1 = std::min(inter, 16 * b1);
        for (int64_t t = 0; c0 < c1 && t < T; ++t) {  // the vector loop's grouping, and a row's tail as a whole row's
          const float* g = gate_up.data() + t * L.gate_up.N;
          silu_mul_row(g + c0, g + inter + c0, c1 - c0, act.data() + t * inter + c0);
        }
      }
      barrier.wait(team);
      project_share(down_w, act.data(), T, local, tid, team, m.data());
      row_parallel_tail(act.data(), L.down, L.down_lora, bias_after, m.data(), team);
      if (!error.empty()) break;
      // 6. h = h2 + m (m is rewritten only after the next layer's first barrier)
      for (int64_t t = 0; t < T; ++t) {
        add_row(local.h2.data() + t * hidden, m.data() + t * hidden, hidden, local.h.data() + t * hidden);
      }
    }
    if (tid == 0 && error.empty()) std::memcpy(step.out, local.h.data(), static_cast<size_t>(T * hidden) * sizeof(float));
  }
  return error;
}

}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("use_decode_region(bool enabled) -> bool", &tpserve::use_decode_region);
  m.def("decode_region_steps() -> int", &tpserve::decode_region_steps);
}
