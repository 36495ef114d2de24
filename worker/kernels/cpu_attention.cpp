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
//
// Why a kernel: without one, attention gathers each sequence's whole K and V through its block
// table into a dense buffer (a copy of the context per layer per step) and runs a general SDPA
// over the padded batch. Here each (sequence, KV head) pair reads its keys and values where they
// lie in the cache, once, for all the query heads that share them, with an exact two-pass softmax
// (scores, then max-subtracted exponentials; Milakov & Gimelshein 2018 give the same result
// online), the exponential vectorised (vec_math.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using tpserve::exp256;
using tpserve::hmax;
using tpserve::hsum;

// Four dot products of 8*D8 floats at once: q (in registers) against keys k0..k3; independent FMA
// chains, then one horizontal reduction for the four.
template <int D8>
inline __m128 dot4(const __m256 (&q)[D8], const float* k0, const float* k1, const float* k2, const float* k3) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int i = 0; i < D8; ++i) {
    a0 = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(k0 + 8 * i), a0);
    a1 = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(k1 + 8 * i), a1);
    a2 = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(k2 + 8 * i), a2);
    a3 = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(k3 + 8 * i), a3);
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

// Prefetch 4 consecutive rows (positions) of one head: the pointer array is padded past the end.
template <int D8>
inline void prefetch_rows(const float* const* rows) {
  for (int r = 0; r < 4; ++r) {
    for (int line = 0; line < D8; line += 2) _mm_prefetch(reinterpret_cast<const char*>(rows[r] + 8 * line), _MM_HINT_T0);
  }
}

// One query row and KV head: `groups` query heads q[g * q_head_stride ..] of size d = 8 * D8 over
// the first `context` keys and values, given as row pointers (padded with 4 more for dot4).
template <int D8>
void attend(const float* q, int64_t q_head_stride, int64_t groups, const float* const* keys,
            const float* const* values, int64_t context, float scale, float softcap, float* out,
            int64_t out_head_stride, std::vector<float>& scores) {
  scores.resize(static_cast<size_t>(context + 4));
  float* s = scores.data();
  for (int64_t g = 0; g < groups; ++g) {
    // Pass 1: scores, keys of 4 positions at a time against the head's query held in registers.
    __m256 qv[D8];
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int i = 0; i < D8; ++i) qv[i] = _mm256_mul_ps(_mm256_loadu_ps(q + g * q_head_stride + 8 * i), vscale);
    for (int64_t t = 0; t < context; t += 4) {
      if (g == 0) prefetch_rows<D8>(keys + t + kAhead);  // the first query head streams K from memory
      _mm_storeu_ps(s + t, dot4<D8>(qv, keys[t], keys[t + 1], keys[t + 2], keys[t + 3]));  // s has 4 spare
    }
    if (softcap > 0.0f) {  // Gemma 2: cap * tanh(score / cap), before the softmax (scalar: a rare path)
      for (int64_t u = 0; u < context; ++u) s[u] = softcap * std::tanh(s[u] / softcap);
    }
    // Softmax, exact: subtract the max, exponentiate, normalise at the end.
    __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 8 <= context; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + t));
    float m = hmax(vmax);
    for (; t < context; ++t) m = std::max(m, s[t]);
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    for (t = 0; t + 8 <= context; t += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
      _mm256_storeu_ps(s + t, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    for (; t < context; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    // Pass 2: the probability-weighted sum of values, accumulated in registers.
    __m256 o[D8];
    for (int i = 0; i < D8; ++i) o[i] = _mm256_setzero_ps();
    for (t = 0; t < context; ++t) {
      if (g == 0 && (t & 3) == 0) prefetch_rows<D8>(values + t + kAhead);
      const __m256 pt = _mm256_set1_ps(s[t]);
      const float* v = values[t];
      for (int i = 0; i < D8; ++i) o[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * i), o[i]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    float* og = out + g * out_head_stride;
    for (int i = 0; i < D8; ++i) _mm256_storeu_ps(og + 8 * i, _mm256_mul_ps(o[i], inv));
  }
}

using AttendFn = void (*)(const float*, int64_t, int64_t, const float* const*, const float* const*, int64_t, float,
                          float, float*, int64_t, std::vector<float>&);

AttendFn attend_for(int64_t d) {
  switch (d) {
    case 16: return &attend<2>;
    case 32: return &attend<4>;
    case 64: return &attend<8>;
    case 80: return &attend<10>;
    case 96: return &attend<12>;
    case 128: return &attend<16>;
    default: return nullptr;
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& context_lens, double scale, int64_t sliding_window,
                           double logit_softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "tpserve paged_attention: q (R, H, d), caches (num_blocks, block_size, KVH, d)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "tpserve paged_attention: float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && q.stride(2) == 1,
              "tpserve paged_attention: contiguous caches and head vectors");
  for (const at::Tensor* t : {&block_tables, &query_start_loc, &context_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "tpserve paged_attention: block_tables, query_start_loc and context_lens must be contiguous int64");
  }
  const int64_t R = q.size(0), H = q.size(1), d = q.size(2), S = context_lens.numel();
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  const AttendFn attend_fn = attend_for(d);
  TORCH_CHECK(k_cache.size(3) == d && attend_fn != nullptr, "tpserve paged_attention: head_dim ", d,
              " must match the cache and be one of 16, 32, 64, 80, 96, 128");
  TORCH_CHECK(H % KVH == 0 && block_tables.dim() == 2 && block_tables.size(0) == S && query_start_loc.numel() == S + 1,
              "tpserve paged_attention: shapes disagree");
  TORCH_CHECK(sliding_window >= 0 && logit_softcap >= 0.0,
              "tpserve paged_attention: sliding_window and logit_softcap must be >= 0 (0: none)");
  const int64_t groups = H / KVH, max_blocks = block_tables.size(1);
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
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), token_stride = KVH * d;
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const float*> keys, values;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / KVH, j = item % KVH, L = lens[s], first = starts[s], n = starts[s + 1] - first;
      // The first position any row reads: 0, or the first row's window start (earlier blocks are skipped).
      const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, L - n - sliding_window + 1) : 0;
      // Where each position's key and value lie, once for all of the sequence's query rows.
      keys.resize(static_cast<size_t>(L - lo + 4 + kAhead));
      values.resize(static_cast<size_t>(L - lo + 4 + kAhead));
      const int64_t* table = tables + s * max_blocks;
      for (int64_t t = lo; t < L; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        keys[t - lo] = kp + slot * token_stride + j * d;
        values[t - lo] = vp + slot * token_stride + j * d;
      }
      // Past the end: dot4's last group reads (never uses) keys[L..L+3]; the prefetches look kAhead further.
      for (int64_t t = L; t < L + 4 + kAhead; ++t) {
        keys[t - lo] = keys[L - 1 - lo];
        values[t - lo] = values[L - 1 - lo];
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = first + i, p = L - n + i;  // the row's position
        const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, p - sliding_window + 1) : 0;
        attend_fn(qp + row * qs0 + j * groups * qs1, qs1, groups, keys.data() + (start - lo),
                  values.data() + (start - lo), p + 1 - start, static_cast<float>(scale),
                  static_cast<float>(logit_softcap), op + (row * H + j * groups) * d, d, scores);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start_loc, "
        "Tensor context_lens, float scale, int sliding_window=0, float logit_softcap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
