// Attention over the paged KV cache on AVX2 CPUs for sequences that feed a few tokens each
// (decodes: one; speculative verification or a short prompt chunk: a few).
//
// Sequence s owns query rows [query_start_loc[s], query_start_loc[s + 1]) = n rows, the last n
// of its L = context_lens[s] positions. For its i-th row (position L - n + i), query head h (KV
// head j = h / (H / KVH), grouped-query attention, Ainslie et al. 2023) and causal positions
// t <= L - n + i, with K/V of position t at slot block_tables[s, t / block_size] * block_size +
// t % block_size (already written for this step's tokens):
//
//     out[row, h] = sum_t softmax_t(cap(scale * q[row, h] . k[t, j])) v[t, j]
//
// where cap(x) = x, or logit_softcap * tanh(x / logit_softcap) when logit_softcap > 0 (Gemma 2's
// attention-logit soft-capping), and, with sliding_window = W > 0, t also runs only over the W
// positions t > p - W of a row at position p (Hugging Face's sliding_window: Mistral, Qwen2,
// Gemma 2/3). Positions before the first row's window are never read: their blocks are skipped.
// With sinks (gpt-oss's attention sinks, one learned logit per query head), the softmax's
// denominator also holds exp(sinks[h]): the sink takes probability mass but adds no value,
//
//     out[row, h] = sum_t exp(x_t) v[t, j] / (exp(sinks[h]) + sum_t exp(x_t)),   x_t = cap(scale * q . k[t, j])
//
// (transformers' modeling_gpt_oss.py eager_attention_forward: the sink is a last column of the
// logits, dropped after the softmax). Without sinks nothing of this runs: one pointer test per row.
//
// An 8-bit cache (--kv-cache-dtype int8 or fp8; worker/kv_quant.py) holds codes c with k[t, j, i] =
// c * k_scale[block(t), j, t % block_size] + k_offset[j, i], v[t, j, i] = c * v_scale[..] (bfloat16 scales,
// a KV head's of a block contiguous; a float32 key offset per KV head and channel). The kernel reads the
// bytes where they lie and converts 8 at a time in registers (kv_codes.h's load8: int8 sign-extended;
// e4m3's sign, exponent and mantissa bits moved into a float32's, times 2^120, the exponent-bias
// difference, subnormals too), and applies the scales where they cost least: each (sequence, KV head) first
// widens its positions' scales to float32, 8 at a time a block (position_scales); then q . k =
// k_scale[t] (q . c) + q . k_offset, so the key scales of 4 positions multiply their 4 scores in one FMA
// that adds q . k_offset (one dot product per query row and head), and a value's scale multiplies its
// probability in the softmax's pass (8 at a time), leaving the value pass as a float32 cache's. A
// position's row is a quarter of a float32 cache's bytes plus 4 bytes of scales per KV head.
//
// Why a kernel: without one, attention gathers each sequence's whole K and V through its block
// table into a dense buffer (a copy of the context per layer per step) and runs a general SDPA
// over the padded batch. Here each (sequence, KV head) pair reads its keys and values where they
// lie in the cache, once, for all the query heads that share them, with an exact two-pass softmax
// (scores, then max-subtracted exponentials; Milakov & Gimelshein 2018 give the same result
// online), the exponential vectorised (vec_math.h).
//
// Where a decode step's time goes with small heads (the embedded model: d = 16, 8 query heads over
// 4 KV heads, 64 sequences of ~70 positions, 2.4 MB of K/V per layer): computing each position's
// address (one division per position), dependent FMA chains in the value pass, and waiting for
// K/V lines that a step's other layers evicted. So: addresses once per sequence, one block-table
// read per block, shared by its KV heads; the query heads of a KV head in one pass (shared loads,
// independent chains); small token rows (all KV heads of a position) prefetched whole by the
// sequence's first head, and the next sequence's rows prefetched while this one's first head runs
// (one layer's call at 74 positions inside a bare decode step, single noisy measurements: 361 us before,
// 190-207 with the first three, ~125 with the next sequence's rows too; alone, cache-warm: 172 -> 82).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include "kv_codes.h"
#include "paged_attention.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using tpserve::Fp8E4M3;  // the 8-bit cache's helpers (kv_codes.h)
using tpserve::FlushSubnormals;
using tpserve::load8;
using tpserve::ScaleRows;
using tpserve::widen_bf16;

// Cache elements per 64-byte line.
template <typename T>
constexpr int64_t kPerLine = 64 / static_cast<int64_t>(sizeof(T));

using tpserve::exp256;
using tpserve::hmax;
using tpserve::hsum;

// Four dot products of 8*D8 floats at once: q (in registers) against keys k0..k3; independent FMA
// chains, then one horizontal reduction for the four.
template <int D8, typename T>
inline __m128 dot4(const __m256 (&q)[D8], const T* k0, const T* k1, const T* k2, const T* k3) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int i = 0; i < D8; ++i) {
    a0 = _mm256_fmadd_ps(q[i], load8(k0 + 8 * i), a0);
    a1 = _mm256_fmadd_ps(q[i], load8(k1 + 8 * i), a1);
    a2 = _mm256_fmadd_ps(q[i], load8(k2 + 8 * i), a2);
    a3 = _mm256_fmadd_ps(q[i], load8(k3 + 8 * i), a3);
  }
  // hadd twice leaves [a0 a1 a2 a3] partial sums in each 128-bit half; add the halves.
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Positions a pass prefetches ahead of the one it reads. The rows of one KV head are 4 * D8 cache
// lines spread over blocks that need not be adjacent, so the hardware prefetchers lose the stream
// at every block boundary; asking for the rows a few positions ahead keeps memory busy
// (16 sequences of 195 positions, 30 layers, blocks in random order: 13.3 -> 12.0 ms, the median of
// 20 interleaved runs against the version without).
constexpr int64_t kAhead = 16;

// Token rows of at most this many cache lines (all KV heads of a position: KVH * d floats) are
// prefetched whole by the sequence's first KV head, so its other heads find their rows in L1
// (the embedded model: 4 lines; a wider row is prefetched head by head, the head's own lines).
constexpr int64_t kWholeRowLines = 8;

// Prefetch `lines` cache lines at each of 4 consecutive positions (the offset array is padded past the end).
template <typename T>
inline void prefetch_rows(const T* base, const int64_t* off, int64_t lines) {
  for (int r = 0; r < 4; ++r) {
    for (int64_t line = 0; line < lines; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(base + off[r] + kPerLine<T> * line), _MM_HINT_T0);
    }
  }
}

// Where each position's key and value lie: off[t - lo] = slot(t) * token_stride for t in [lo, L),
// one block-table read per block (no division per position), then 4 + kAhead copies of the last
// offset (dot4 reads 4 positions at a time, the prefetches look kAhead further).
void position_offsets(const int64_t* table, int64_t block_size, int64_t token_stride, int64_t lo, int64_t L,
                      std::vector<int64_t>& off) {
  off.resize(static_cast<size_t>(L - lo + 4 + kAhead));
  int64_t* o = off.data() - lo;
  for (int64_t t = lo; t < L;) {
    const int64_t block = t / block_size, end = std::min(L, (block + 1) * block_size);
    const int64_t base = (table[block] * block_size - block * block_size) * token_stride;  // slot(t) - t, scaled
    for (; t < end; ++t) o[t] = base + t * token_stride;
  }
  for (int64_t t = L; t < L + 4 + kAhead; ++t) o[t] = o[L - 1];
}

// One KV head's scales of positions [lo, L) as float32: k[t - first], v[t - first] with first = lo rounded
// down to its block (pools (num_blocks, KVH, block_size) bfloat16: a head's scales of a block are
// contiguous), then 8 + 4 + kAhead zeros (the passes' vectors and look-ahead read past L).
void position_scales(const int64_t* table, int64_t block_size, int64_t KVH, int64_t j, int64_t lo, int64_t L,
                     const uint16_t* k_pool, const uint16_t* v_pool, std::vector<float>& k, std::vector<float>& v) {
  const int64_t first = lo / block_size * block_size, n = L - first;
  k.resize(static_cast<size_t>(n + 12 + kAhead));
  v.resize(static_cast<size_t>(n + 12 + kAhead));
  for (int64_t b = lo / block_size; b * block_size < L; ++b) {
    const int64_t at = (table[b] * KVH + j) * block_size, m = std::min(block_size, L - b * block_size);
    widen_bf16(k_pool + at, k.data() + (b * block_size - first), m);
    widen_bf16(v_pool + at, v.data() + (b * block_size - first), m);
  }
  std::fill(k.begin() + n, k.end(), 0.0f);
  std::fill(v.begin() + n, v.end(), 0.0f);
}

// The first position any of a sequence's n rows reads: 0, or with a sliding window the first row's
// window start (earlier blocks are skipped).
inline int64_t first_position(int64_t L, int64_t n, int64_t sliding_window) {
  return sliding_window > 0 ? std::max<int64_t>(0, L - n - sliding_window + 1) : 0;
}

// The kernel's per-call constants for one KV head of one sequence.
template <typename T>
struct HeadView {
  const T* keys;    // k_cache + j * d: key of position t at keys + off[t]
  const T* values;  // likewise in v_cache
  const T* kpf;     // what to prefetch (nullptr: nothing): kpf + off[t], pf_lines lines
  const T* vpf;
  int64_t pf_lines;
  const int64_t* next_off = nullptr;  // the next sequence's offsets, prefetched (whole rows) as these are read
  int64_t next_len = 0;               // its positions
};

// One query row and G query heads sharing one KV head: q[g * q_head_stride ..] (d = 8 * D8) over
// the first `context` positions of `off`. The G heads share every key and value load, and their
// accumulators are independent chains (the value pass, a chain of FMAs per position, is
// latency-bound with one head and d = 16).
// `sc`: an 8-bit cache's scales for this KV head (k folded into the queries, v into the output).
template <int D8, int G, typename T>
void attend(const float* q, int64_t q_head_stride, const HeadView<T>& h, const int64_t* off, int64_t context,
            float scale, ScaleRows sc, float softcap, const float* sink, float* out, int64_t out_head_stride,
            std::vector<float>& scores) {
  const int64_t stride = context + 8;  // per head: dot4's 3 spare, the softmax's last vector 7
  scores.resize(static_cast<size_t>(G * stride));
  float* s = scores.data();
  // Pass 1: scores, keys of 4 positions at a time against the heads' queries held in registers.
  constexpr bool kCodes = !std::is_same_v<T, float>;
  __m256 qv[G][D8];
  __m128 qmu[G];  // an 8-bit cache: scale * q . k_offset, added to every score
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int g = 0; g < G; ++g) {
    for (int i = 0; i < D8; ++i) qv[g][i] = _mm256_mul_ps(_mm256_loadu_ps(q + g * q_head_stride + 8 * i), vscale);
    if constexpr (kCodes) {
      __m256 a = _mm256_setzero_ps();
      for (int i = 0; i < D8; ++i) a = _mm256_fmadd_ps(qv[g][i], _mm256_loadu_ps(sc.offset + 8 * i), a);
      qmu[g] = _mm_set1_ps(hsum(a));
    }
  }
  for (int64_t t = 0; t < context; t += 4) {
    if (h.kpf) prefetch_rows(h.kpf, off + t + kAhead, h.pf_lines);
    if (h.next_off && t < h.next_len) prefetch_rows(h.kpf, h.next_off + t, h.pf_lines);
    const T *k0 = h.keys + off[t], *k1 = h.keys + off[t + 1], *k2 = h.keys + off[t + 2], *k3 = h.keys + off[t + 3];
    if constexpr (kCodes) {  // each position's key scale multiplies its score
      const __m128 ks = _mm_loadu_ps(sc.k + t);
      for (int g = 0; g < G; ++g) {
        _mm_storeu_ps(s + g * stride + t, _mm_fmadd_ps(dot4<D8, T>(qv[g], k0, k1, k2, k3), ks, qmu[g]));
      }
    } else {
      for (int g = 0; g < G; ++g) _mm_storeu_ps(s + g * stride + t, dot4<D8, T>(qv[g], k0, k1, k2, k3));
    }
  }
  // Softmax per head, exact: subtract the max, exponentiate, normalise at the end.
  const __m256 kLane = _mm256_setr_ps(0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f);
  float inv_sum[G];
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * stride;
    if (softcap > 0.0f) {  // Gemma 2: cap * tanh(score / cap), before the softmax (scalar: a rare path)
      for (int64_t u = 0; u < context; ++u) sg[u] = softcap * std::tanh(sg[u] / softcap);
    }
    __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 8 <= context; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sg + t));
    float m = hmax(vmax);
    for (; t < context; ++t) m = std::max(m, sg[t]);
    if (sink) m = std::max(m, sink[g]);  // the sink is one more logit: the max covers it (no overflow)
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    // An 8-bit cache: each position's weight in the value pass is its probability times its value's scale.
    for (t = 0; t + 8 <= context; t += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), vm));
      _mm256_storeu_ps(sg + t, kCodes ? _mm256_mul_ps(e, _mm256_loadu_ps(sc.v + t)) : e);
      vsum = _mm256_add_ps(vsum, e);
    }
    if (t < context) {  // the last 1..7 positions: one more vector, the lanes past the end zeroed
      const __m256 valid = _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps(static_cast<float>(t)), kLane),
                                         _mm256_set1_ps(static_cast<float>(context)), _CMP_LT_OQ);
      const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), vm)), valid);
      _mm256_storeu_ps(sg + t, kCodes ? _mm256_mul_ps(e, _mm256_loadu_ps(sc.v + t)) : e);  // within the stride
      vsum = _mm256_add_ps(vsum, e);
    }
    const float sink_mass = sink ? std::exp(sink[g] - m) : 0.0f;  // in the denominator only: it has no value
    inv_sum[g] = 1.0f / (hsum(vsum) + sink_mass);
  }
  // Pass 2: the probability-weighted sum of values, accumulated in registers; with few
  // accumulators, two positions at a time into two sets (more chains in flight), added at the end.
  constexpr int kSets = G * D8 <= 4 ? 2 : 1;
  __m256 o[kSets][G][D8];
  for (int u = 0; u < kSets; ++u) {
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < D8; ++i) o[u][g][i] = _mm256_setzero_ps();
    }
  }
  int64_t t = 0;
  for (; t + kSets <= context; t += kSets) {
    if (h.vpf && (t & 3) < kSets) {
      prefetch_rows(h.vpf, off + (t & ~int64_t{3}) + kAhead, h.pf_lines);
      if (h.next_off && t < h.next_len) prefetch_rows(h.vpf, h.next_off + (t & ~int64_t{3}), h.pf_lines);
    }
    for (int u = 0; u < kSets; ++u) {
      const T* v = h.values + off[t + u];
      for (int i = 0; i < D8; ++i) {
        const __m256 vv = load8(v + 8 * i);
        for (int g = 0; g < G; ++g) o[u][g][i] = _mm256_fmadd_ps(_mm256_set1_ps(s[g * stride + t + u]), vv, o[u][g][i]);
      }
    }
  }
  for (; t < context; ++t) {  // kSets = 2 and an odd context: the last position
    const T* v = h.values + off[t];
    for (int i = 0; i < D8; ++i) {
      const __m256 vv = load8(v + 8 * i);
      for (int g = 0; g < G; ++g) o[0][g][i] = _mm256_fmadd_ps(_mm256_set1_ps(s[g * stride + t]), vv, o[0][g][i]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m256 inv = _mm256_set1_ps(inv_sum[g]);
    float* og = out + g * out_head_stride;
    for (int i = 0; i < D8; ++i) {
      __m256 acc = o[0][g][i];
      for (int u = 1; u < kSets; ++u) acc = _mm256_add_ps(acc, o[u][g][i]);
      acc = _mm256_mul_ps(acc, inv);
      _mm256_storeu_ps(og + 8 * i, acc);
    }
  }
}

template <typename T>
using AttendFn = void (*)(const float*, int64_t, const HeadView<T>&, const int64_t*, int64_t, float, ScaleRows, float,
                          const float*, float*, int64_t, std::vector<float>&);

// All `groups` query heads of one KV head, G at a time (G: as many as keep the queries and the
// value accumulators within the 16 ymm registers).
template <int D8, typename T>
void attend_group(AttendFn<T> one, AttendFn<T> two, AttendFn<T> four, int64_t groups, const float* q,
                  int64_t q_head_stride, const HeadView<T>& h, const int64_t* off, int64_t context, float scale,
                  ScaleRows sc, float softcap, const float* sink, float* out, int64_t out_head_stride,
                  std::vector<float>& scores) {
  int64_t g = 0;
  for (; four && g + 4 <= groups; g += 4) {
    four(q + g * q_head_stride, q_head_stride, h, off, context, scale, sc, softcap, sink ? sink + g : nullptr,
         out + g * out_head_stride,
         out_head_stride, scores);
  }
  for (; two && g + 2 <= groups; g += 2) {
    two(q + g * q_head_stride, q_head_stride, h, off, context, scale, sc, softcap, sink ? sink + g : nullptr,
         out + g * out_head_stride,
        out_head_stride, scores);
  }
  for (; g < groups; ++g) {
    one(q + g * q_head_stride, q_head_stride, h, off, context, scale, sc, softcap, sink ? sink + g : nullptr,
         out + g * out_head_stride,
        out_head_stride, scores);
  }
}

template <typename T>
using GroupFn = void (*)(int64_t, const float*, int64_t, const HeadView<T>&, const int64_t*, int64_t, float,
                         ScaleRows, float, const float*, float*, int64_t, std::vector<float>&);

template <int D8, typename T>
void attend_heads(int64_t groups, const float* q, int64_t q_head_stride, const HeadView<T>& h, const int64_t* off,
                  int64_t context, float scale, ScaleRows sc, float softcap, const float* sink, float* out,
                  int64_t out_head_stride, std::vector<float>& scores) {
  // Head sizes up to 32 (D8 <= 4) take 2 heads at a time, 16 (D8 = 2) 4; wider heads one.
  constexpr bool two = D8 <= 4, four = D8 <= 2;
  attend_group<D8, T>(&attend<D8, 1, T>, two ? &attend<D8, two ? 2 : 1, T> : nullptr,
                      four ? &attend<D8, four ? 4 : 1, T> : nullptr, groups, q, q_head_stride, h, off, context,
                      scale, sc, softcap, sink, out, out_head_stride, scores);
}

template <typename T>
GroupFn<T> attend_for(int64_t d) {
  switch (d) {
    case 16: return &attend_heads<2, T>;
    case 32: return &attend_heads<4, T>;
    case 64: return &attend_heads<8, T>;
    case 80: return &attend_heads<10, T>;
    case 96: return &attend_heads<12, T>;
    case 128: return &attend_heads<16, T>;
    default: return nullptr;
  }
}

template <typename T>
void paged_attention_impl(const at::Tensor& q, const T* kp, const T* vp, int64_t block_size, int64_t KVH,
                          const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                          const at::Tensor& context_lens, float scale, const uint16_t* k_scale,
                          const uint16_t* v_scale, const float* k_offset, int64_t sliding_window, float logit_softcap,
                          const float* sink_p, at::Tensor& out);

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& context_lens, double scale, int64_t sliding_window,
                           double logit_softcap, const std::optional<at::Tensor>& sinks,
                           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                           const std::optional<at::Tensor>& k_offset) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "tpserve paged_attention: q (R, H, d), caches (num_blocks, block_size, KVH, d)");
  const at::ScalarType cache_type = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && v_cache.scalar_type() == cache_type &&
                  (cache_type == at::kFloat || cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn),
              "tpserve paged_attention: float32 queries; float32, int8 or float8_e4m3fn caches");
  TORCH_CHECK((cache_type == at::kFloat) == (!k_scale.has_value() && !v_scale.has_value() && !k_offset.has_value()),
              "tpserve paged_attention: an 8-bit cache takes k_scale, v_scale and k_offset, a float32 cache none");
  for (const std::optional<at::Tensor>* t : {&k_scale, &v_scale}) {
    TORCH_CHECK(!t->has_value() || ((*t)->scalar_type() == at::kBFloat16 && (*t)->is_contiguous() &&
                                    (*t)->dim() == 3 && (*t)->size(0) == k_cache.size(0) &&
                                    (*t)->size(1) == k_cache.size(2) && (*t)->size(2) == k_cache.size(1)),
                "tpserve paged_attention: k_scale and v_scale must be contiguous bfloat16 (num_blocks, KVH, block_size)");
  }
  TORCH_CHECK(!k_offset.has_value() || (k_offset->scalar_type() == at::kFloat && k_offset->is_contiguous() &&
                                        k_offset->dim() == 2 && k_offset->size(0) == k_cache.size(2) &&
                                        k_offset->size(1) == k_cache.size(3)),
              "tpserve paged_attention: k_offset must be contiguous float32 (KVH, d)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && q.stride(2) == 1,
              "tpserve paged_attention: contiguous caches and head vectors");
  for (const at::Tensor* t : {&block_tables, &query_start_loc, &context_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "tpserve paged_attention: block_tables, query_start_loc and context_lens must be contiguous int64");
  }
  const int64_t R = q.size(0), H = q.size(1), d = q.size(2), S = context_lens.numel();
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && attend_for<float>(d) != nullptr, "tpserve paged_attention: head_dim ", d,
              " must match the cache and be one of 16, 32, 64, 80, 96, 128");
  TORCH_CHECK(H % KVH == 0 && block_tables.dim() == 2 && block_tables.size(0) == S && query_start_loc.numel() == S + 1,
              "tpserve paged_attention: shapes disagree");
  TORCH_CHECK(sliding_window >= 0 && logit_softcap >= 0.0,
              "tpserve paged_attention: sliding_window and logit_softcap must be >= 0 (0: none)");
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                    sinks->size(0) == H,
                "tpserve paged_attention: sinks must be a contiguous float32 (H,) tensor, one logit per query head");
  }
  const float* sink_p = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[S] == R, "tpserve paged_attention: query_start_loc must run from 0 to ", R);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = starts[s + 1] - starts[s];
    TORCH_CHECK(n >= 1 && lens[s] >= n && lens[s] <= max_blocks * block_size, "tpserve paged_attention: sequence ",
                s, " has ", n, " query rows and context length ", lens[s], " (its block table holds ",
                max_blocks * block_size, ")");
  }
  at::Tensor out = at::empty({R, H, d}, q.options());
  const float qk_scale = static_cast<float>(scale), cap = static_cast<float>(logit_softcap);
  const auto* ks = k_scale.has_value() ? static_cast<const uint16_t*>(k_scale->data_ptr()) : nullptr;
  const auto* vs = v_scale.has_value() ? static_cast<const uint16_t*>(v_scale->data_ptr()) : nullptr;
  const float* ko = k_offset.has_value() ? k_offset->data_ptr<float>() : nullptr;
  if (cache_type == at::kFloat) {
    paged_attention_impl<float>(q, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), block_size, KVH,
                                block_tables, query_start_loc, context_lens, qk_scale, ks, vs, ko, sliding_window, cap,
                                sink_p, out);
  } else if (cache_type == at::kChar) {
    paged_attention_impl<int8_t>(q, static_cast<const int8_t*>(k_cache.data_ptr()),
                                 static_cast<const int8_t*>(v_cache.data_ptr()), block_size, KVH, block_tables,
                                 query_start_loc, context_lens, qk_scale, ks, vs, ko, sliding_window, cap, sink_p, out);
  } else {
    paged_attention_impl<Fp8E4M3>(q, static_cast<const Fp8E4M3*>(k_cache.data_ptr()),
                                  static_cast<const Fp8E4M3*>(v_cache.data_ptr()), block_size, KVH, block_tables,
                                  query_start_loc, context_lens, qk_scale, ks, vs, ko, sliding_window, cap, sink_p, out);
  }
  return out;
}

}  // namespace

namespace tpserve {

template <typename T>
void paged_attention_items(const PagedCall<T>& c, int64_t begin, int64_t end) {
  if (begin >= end) return;
  const int64_t KVH = c.KVH, H = c.H, d = c.d, block_size = c.block_size, max_blocks = c.max_blocks;
  const GroupFn<T> attend_fn = attend_for<T>(d);
  const int64_t groups = H / KVH;
  const int64_t* lens = c.context_lens;
  const int64_t* starts = c.query_start_loc;
  const int64_t* tables = c.block_tables;
  const float* qp = c.q;
  float* op = c.out;
  const T* kp = c.k_cache;
  const T* vp = c.v_cache;
  const uint16_t* k_scale = c.k_scale;
  const uint16_t* v_scale = c.v_scale;
  const float* k_offset = c.k_offset;
  const float* sink_p = c.sinks;
  const int64_t sliding_window = c.sliding_window;
  const float scale = c.scale, logit_softcap = c.logit_softcap;
  const int64_t qs0 = c.q_row_stride, qs1 = c.q_head_stride, token_stride = KVH * d;
  const int64_t row_lines = (token_stride + kPerLine<T> - 1) / kPerLine<T>;
  const int64_t head_lines = (d + kPerLine<T> - 1) / kPerLine<T>;
  const bool whole_rows = row_lines <= kWholeRowLines;
  const FlushSubnormals flush(!std::is_same_v<T, float>);
  // Kept per thread: a decode step calls this once a layer per thread (cpu_decode_region.cpp).
  thread_local std::vector<float> scores, kscales, vscales;
  thread_local std::vector<int64_t> off, next;
  int64_t offsets_of = -1, next_of = -1;  // the sequences `off` and `next` hold
  const int64_t last = (end - 1) / KVH;  // this thread's last sequence
  for (int64_t item = begin; item < end; ++item) {
    const int64_t s = item / KVH, j = item % KVH, L = lens[s], first = starts[s], n = starts[s + 1] - first;
    const int64_t lo = first_position(L, n, sliding_window);
    const bool lead = s != offsets_of;  // this thread's first KV head of the sequence
    if (lead) {
      if (next_of == s) {
        off.swap(next);
      } else {
        position_offsets(tables + s * max_blocks, block_size, token_stride, lo, L, off);
      }
      offsets_of = s;
    }
    HeadView<T> h{kp + j * d, vp + j * d, nullptr, nullptr, head_lines};
    if (lead && whole_rows) {  // whole token rows, for this and the sequence's other heads
      h.kpf = kp, h.vpf = vp, h.pf_lines = row_lines;
      if (s < last) {  // and the next sequence's, while this one is read (its first head then finds them)
        const int64_t next_n = starts[s + 2] - starts[s + 1], next_lo = first_position(lens[s + 1], next_n,
                                                                                       sliding_window);
        position_offsets(tables + (s + 1) * max_blocks, block_size, token_stride, next_lo, lens[s + 1], next);
        next_of = s + 1;
        h.next_off = next.data(), h.next_len = lens[s + 1] - next_lo;
      }
    } else if (!whole_rows) {  // wide rows: each head its own lines
      h.kpf = h.keys, h.vpf = h.values;
    }
    const int64_t aligned = lo / block_size * block_size;  // where this head's scale arrays start
    if (k_scale) position_scales(tables + s * max_blocks, block_size, KVH, j, lo, L, k_scale, v_scale, kscales,
                                 vscales);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = first + i, p = L - n + i;  // the row's position
      const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, p - sliding_window + 1) : 0;
      attend_fn(groups, qp + row * qs0 + j * groups * qs1, qs1, h, off.data() + (start - lo), p + 1 - start,
                scale, ScaleRows{k_scale ? kscales.data() + (start - aligned) : nullptr,
                                 k_scale ? vscales.data() + (start - aligned) : nullptr,
                                 k_offset ? k_offset + j * d : nullptr},
                logit_softcap,
                sink_p ? sink_p + j * groups : nullptr, op + (row * H + j * groups) * d, d, scores);
    }
  }
}

template void paged_attention_items<float>(const PagedCall<float>&, int64_t, int64_t);
template void paged_attention_items<int8_t>(const PagedCall<int8_t>&, int64_t, int64_t);
template void paged_attention_items<Fp8E4M3>(const PagedCall<Fp8E4M3>&, int64_t, int64_t);

bool paged_attention_head_size(int64_t d) { return attend_for<float>(d) != nullptr; }

}  // namespace tpserve

namespace {

template <typename T>
void paged_attention_impl(const at::Tensor& q, const T* kp, const T* vp, int64_t block_size, int64_t KVH,
                          const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                          const at::Tensor& context_lens, float scale, const uint16_t* k_scale,
                          const uint16_t* v_scale, const float* k_offset, int64_t sliding_window, float logit_softcap,
                          const float* sink_p, at::Tensor& out) {
  const tpserve::PagedCall<T> call{q.data_ptr<float>(), q.stride(0), q.stride(1), kp, vp, block_size, KVH, q.size(1),
                                   q.size(2), block_tables.data_ptr<int64_t>(), block_tables.size(1),
                                   query_start_loc.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                                   context_lens.numel(), scale, k_scale, v_scale, k_offset, sliding_window,
                                   logit_softcap, sink_p, out.data_ptr<float>()};
  at::parallel_for(0, call.S * KVH, 1, [&](int64_t begin, int64_t end) {
    tpserve::paged_attention_items(call, begin, end);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
        "Tensor context_lens, float scale, int sliding_window=0, float logit_softcap=0.0, Tensor? sinks=None, "
        "Tensor? k_scale=None, Tensor? v_scale=None, Tensor? k_offset=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
