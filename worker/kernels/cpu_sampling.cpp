// The sampler's per-vocabulary-entry work for sampled rows (worker/sampler.py), one pass each
// instead of a chain of (N, V) torch ops.
//
// sampling_uniform: the counter-based uniforms of worker/sampler.py's exponential_noise. As torch
// ops the splitmix64 hash of every (row, token) is about fifteen int64 passes over an (N, V)
// tensor (about 0.9 ms at 64 rows of 1,024 tokens on one core); here it is one. Integer
// arithmetic wraps the same way everywhere and the uniform's float conversion is exact, so the
// values are bit for bit those of the tensor version (tests/worker/test_sampler.py checks it).
//
// exponential_race: token = argmax_v probs[v] / (-log_u[v]) (the exponential race) and whether the
// row's probabilities are all finite, in one pass without the (N, V) quotient: the division is the
// same IEEE float32 division as torch's, the argmax keeps the first of equal maxima as torch's does.
//
// Both run 8 tokens at a time on AVX2 (the hash's 64-bit products as three 32-bit ones): 64 rows of
// 1,024 tokens on one AVX-512 core, the uniforms 94-99 -> 46-50 us and the race 72-77 -> 16 us
// against the scalar loops (three interleaved timings of 7 x 200 calls).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;  // splitmix64's increment (Vigna's splitmix64.c)
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kMix2 = 0x94D049BB133111EBULL;
constexpr int kUniformBits = 23;  // worker/sampler.py's _UNIFORM_BITS

inline uint64_t splitmix64(uint64_t x) {
  x += kGolden;
  x = (x ^ (x >> 30)) * kMix1;
  x = (x ^ (x >> 27)) * kMix2;
  return x ^ (x >> 31);
}

// ---- AVX2: 4 lanes of 64-bit arithmetic (no 64-bit multiply in AVX2: three 32 x 32 -> 64 products) ----

// x * m mod 2^64 in each lane, for m given as its low and high 32 bits (m_lo, m_hi in every lane).
inline __m256i mul64(__m256i x, __m256i m_lo, __m256i m_hi) {
  const __m256i lo = _mm256_mul_epu32(x, m_lo);  // x_lo * m_lo, the full 64 bits
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x, 32), m_lo), _mm256_mul_epu32(x, m_hi));
  return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));  // x_hi * m_hi * 2^64 wraps away
}

struct Mix4 {  // splitmix64's constants, as AVX2 lanes
  __m256i golden = _mm256_set1_epi64x(static_cast<int64_t>(kGolden));
  __m256i mix1_lo = _mm256_set1_epi64x(static_cast<int64_t>(kMix1 & 0xFFFFFFFFULL));
  __m256i mix1_hi = _mm256_set1_epi64x(static_cast<int64_t>(kMix1 >> 32));
  __m256i mix2_lo = _mm256_set1_epi64x(static_cast<int64_t>(kMix2 & 0xFFFFFFFFULL));
  __m256i mix2_hi = _mm256_set1_epi64x(static_cast<int64_t>(kMix2 >> 32));
};

// splitmix64 in each of 4 lanes: the same bits as the scalar one.
inline __m256i splitmix64x4(__m256i x, const Mix4& c) {
  x = _mm256_add_epi64(x, c.golden);
  x = mul64(_mm256_xor_si256(x, _mm256_srli_epi64(x, 30)), c.mix1_lo, c.mix1_hi);
  x = mul64(_mm256_xor_si256(x, _mm256_srli_epi64(x, 27)), c.mix2_lo, c.mix2_hi);
  return _mm256_xor_si256(x, _mm256_srli_epi64(x, 31));
}

// One row's uniforms for tokens [0, V): 8 at a time (two 4-lane hashes, even and odd tokens, whose
// top 23 bits interleave into token order), the rest scalar.
void uniform_row(uint64_t key, int64_t V, float scale, float* row) {
  const Mix4 c;
  const int64_t g = static_cast<int64_t>(kGolden), k = static_cast<int64_t>(key);
  // Even tokens v, v + 2, v + 4, v + 6 and the odd ones after them: counter = key + v * golden (wrapping).
  __m256i even = _mm256_set_epi64x(k + 6 * g, k + 4 * g, k + 2 * g, k);
  __m256i odd = _mm256_add_epi64(even, _mm256_set1_epi64x(g));
  const __m256i step = _mm256_set1_epi64x(8 * g);
  const __m256 half = _mm256_set1_ps(0.5f), vscale = _mm256_set1_ps(scale);
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256i e = _mm256_srli_epi64(splitmix64x4(even, c), 64 - kUniformBits);  // < 2^23 in each low half
    const __m256i o = _mm256_srli_epi64(splitmix64x4(odd, c), 64 - kUniformBits);
    const __m256i bits = _mm256_or_si256(e, _mm256_slli_epi64(o, 32));  // 32-bit lanes in token order
    _mm256_storeu_ps(row + v, _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(bits), half), vscale));
    even = _mm256_add_epi64(even, step);
    odd = _mm256_add_epi64(odd, step);
  }
  for (uint64_t counter = key + static_cast<uint64_t>(v) * kGolden; v < V; ++v, counter += kGolden) {
    row[v] = (static_cast<float>(splitmix64(counter) >> (64 - kUniformBits)) + 0.5f) * scale;
  }
}

// (argmax_v p[v] / -l[v], all p finite) of one row: 8 lanes, each keeping its first maximum (strict
// >, false for NaN), then the lanes' largest with the smallest index (the row's first maximum, as
// torch's argmax), the rest scalar.
std::pair<int64_t, bool> race_row(const float* p, const float* l, int64_t V) {
  const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
  __m256 best = _mm256_set1_ps(-INFINITY);
  __m256i best_idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx = best_idx;
  __m256 finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  const __m256i eight = _mm256_set1_epi32(8);
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 pv = _mm256_loadu_ps(p + v);
    const __m256 ratio = _mm256_div_ps(pv, _mm256_xor_ps(_mm256_loadu_ps(l + v), sign));  // torch: probs / -log_u
    finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_sub_ps(pv, pv), zero, _CMP_EQ_OQ));  // inf - inf, NaN: no
    const __m256 better = _mm256_cmp_ps(ratio, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, ratio, better);
    best_idx = _mm256_blendv_epi8(best_idx, idx, _mm256_castps_si256(better));
    idx = _mm256_add_epi32(idx, eight);
  }
  alignas(32) float lane_best[8];
  alignas(32) int32_t lane_idx[8];
  _mm256_store_ps(lane_best, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_idx), best_idx);
  float best_ratio = lane_best[0];
  int64_t best_v = lane_idx[0];
  for (int i = 1; i < 8; ++i) {
    if (lane_best[i] > best_ratio || (lane_best[i] == best_ratio && lane_idx[i] < best_v)) {
      best_ratio = lane_best[i];
      best_v = lane_idx[i];
    }
  }
  bool all_finite = _mm256_movemask_ps(finite) == 0xFF;
  for (; v < V; ++v) {  // after every vector index: strict > keeps the first maximum
    const float ratio = p[v] / -l[v];
    all_finite &= std::isfinite(p[v]);
    if (ratio > best_ratio) {
      best_ratio = ratio;
      best_v = v;
    }
  }
  return {best_v, all_finite};
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous(),
              "tpserve ", what, ": expected contiguous float32 (N, V) CPU tensors");
}

// (N, V) float32: u[i, v] = (top 23 bits of mix(key_i + (v + 1) * golden) + 0.5) / 2^23 with
// key_i = mix(mix(seed_i) ^ position_i), all arithmetic mod 2^64 on the seeds' bit patterns.
at::Tensor sampling_uniform(const at::Tensor& seeds, const at::Tensor& positions, int64_t vocab_size) {
  TORCH_CHECK(seeds.device().is_cpu() && seeds.scalar_type() == at::kLong && seeds.dim() == 1 &&
                  positions.scalar_type() == at::kLong && positions.sizes() == seeds.sizes() && vocab_size >= 0,
              "tpserve sampling_uniform: seeds and positions must be int64 (N,) CPU tensors, vocab_size >= 0");
  const int64_t N = seeds.size(0);
  const at::Tensor s = seeds.contiguous(), p = positions.contiguous();
  at::Tensor out = at::empty({N, vocab_size}, seeds.options().dtype(at::kFloat));
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* pp = p.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float scale = 1.0f / static_cast<float>(1 << kUniformBits);
  at::parallel_for(0, N, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint64_t key = splitmix64(splitmix64(static_cast<uint64_t>(sp[i])) ^ static_cast<uint64_t>(pp[i]));
      // u[v] from h = splitmix64(key + v * golden) (splitmix64 adds the (v + 1)-th golden): its top 23
      // bits are exact in float32, and so are + 0.5 and the power-of-two scale.
      uniform_row(key, vocab_size, scale, op + i * vocab_size);
    }
  });
  return out;
}

// ((N,) int64 argmax_v probs / -log_u, (N,) bool all probs of the row finite).
std::tuple<at::Tensor, at::Tensor> exponential_race(const at::Tensor& probs, const at::Tensor& log_u) {
  check_rows(probs, "exponential_race");
  check_rows(log_u, "exponential_race");
  TORCH_CHECK(probs.sizes() == log_u.sizes(), "tpserve exponential_race: probs and log_u shapes differ");
  const int64_t N = probs.size(0), V = probs.size(1);
  at::Tensor tokens = at::empty({N}, probs.options().dtype(at::kLong));
  at::Tensor finite = at::empty({N}, probs.options().dtype(at::kBool));
  const float* pp = probs.data_ptr<float>();
  const float* lp = log_u.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  bool* fp = finite.data_ptr<bool>();
  at::parallel_for(0, N, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      // torch: probs / noise, noise = -log_u (an exact negation), the same IEEE division.
      const auto [best, all_finite] = race_row(pp + i * V, lp + i * V, V);
      // A row with a non-finite probability takes the greedy token (the caller's where): best is unused.
      tp[i] = best;
      fp[i] = all_finite;
    }
  });
  return {tokens, finite};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("sampling_uniform(Tensor seeds, Tensor positions, int vocab_size) -> Tensor");
  m.def("exponential_race(Tensor probs, Tensor log_u) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) {
  m.impl("sampling_uniform", &sampling_uniform);
  m.impl("exponential_race", &exponential_race);
}
