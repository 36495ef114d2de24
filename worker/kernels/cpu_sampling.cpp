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
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

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
      float* row = op + i * vocab_size;
      uint64_t counter = key;  // key + v * golden; splitmix64 adds the (v + 1)-th golden
      for (int64_t v = 0; v < vocab_size; ++v, counter += kGolden) {
        const uint64_t h = splitmix64(counter);
        // < 2^23: exact in float32, and so are + 0.5 and the power-of-two scale.
        row[v] = (static_cast<float>(h >> (64 - kUniformBits)) + 0.5f) * scale;
      }
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
      const float* p = pp + i * V;
      const float* l = lp + i * V;
      int64_t best = 0;
      float best_ratio = -INFINITY;
      bool all_finite = true;
      for (int64_t v = 0; v < V; ++v) {
        const float ratio = p[v] / -l[v];  // torch: probs / noise, noise = -log_u (an exact negation)
        all_finite &= std::isfinite(p[v]);
        if (ratio > best_ratio) {  // strict: the first of equal maxima, as torch's argmax
          best_ratio = ratio;
          best = v;
        }
      }
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
