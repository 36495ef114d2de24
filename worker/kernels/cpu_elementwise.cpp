// The decoder layer's elementwise work, one pass each instead of a chain of small torch ops:
// RMSNorm (with the residual add fused in), SiLU-and-mul, and RoPE (after an optional per-head
// q/k RMSNorm) with the KV-cache write.
//
// A decode step runs each of these 30-odd times over a few rows; as torch ops they are 5-10
// kernel launches each, whose fixed cost (a few microseconds apiece) is most of a small step's
// time outside the GEMMs. Each function here is float32 only and follows the reference maths
// (transformers' LlamaRMSNorm, SiLU, apply_rotary_pos_emb) with the same operation order, so the
// results agree with the torch path to float32 rounding (tests/worker/test_cpu_kernels.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#include "kv_store.h"
#include "row_math.h"
#include "vec_math.h"

namespace {

using tpserve::add_row;
using tpserve::store_row;
using tpserve::rms_norm_row;
using tpserve::rotate_half_head;
using tpserve::silu_mul_row;

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "tpserve ", what, ": expected a float32 (T, H) CPU tensor with contiguous rows");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  const int64_t T = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat && weight.numel() == n,
              "tpserve rms_norm: weight must be a contiguous float32 (H,) tensor");
  at::Tensor y = at::empty({T, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ld = x.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rms_norm_row(xp + t * ld, wp, static_cast<float>(eps), n, yp + t * n);
  });
  return y;
}

// (residual + x, rms_norm(residual + x)): the residual stream's add and the next norm in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& residual, const at::Tensor& x,
                                                const at::Tensor& weight, double eps) {
  check_rows(residual, "add_rms_norm");
  check_rows(x, "add_rms_norm");
  const int64_t T = x.size(0), n = x.size(1);
  TORCH_CHECK(residual.size(0) == T && residual.size(1) == n, "tpserve add_rms_norm: shapes differ");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat && weight.numel() == n,
              "tpserve add_rms_norm: weight must be a contiguous float32 (H,) tensor");
  at::Tensor sum = at::empty({T, n}, x.options());
  at::Tensor y = at::empty({T, n}, x.options());
  const float* rp = residual.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldr = residual.stride(0), ldx = x.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* s = sp + t * n;
      add_row(rp + t * ldr, xp + t * ldx, n, s);
      rms_norm_row(s, wp, static_cast<float>(eps), n, yp + t * n);
    }
  });
  return {sum, y};
}

// silu(gate) * up for gate_up (T, 2n) laid out [gate | up]; silu(g) = g / (1 + exp(-g)).
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul");
  const int64_t T = gate_up.size(0), n = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "tpserve silu_and_mul: the last dimension must be even");
  at::Tensor y = at::empty({T, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ld = gate_up.stride(0);
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) silu_mul_row(gp + t * ld, gp + t * ld + n, n, yp + t * n);
  });
  return y;
}

// In place on qkv (T, (H + 2 KVH) d): optionally RMS-normalise each query head by q_weight (d) and
// each key head by k_weight (d) (QK-norm: Qwen3, Gemma 3; null weights: none), then rotate the H query
// and KVH key heads by (cos, sin) (T, d), the "rotate half" layout: out[i] = x[i] cos[i] - x[i + d/2] sin[i]
// for i < d/2 and x[i] cos[i] + x[i - d/2] sin[i] above; then write the rotated keys and the values into
// the caches (num_blocks, block_size, KVH, d) at slot_mapping[t]. An 8-bit cache (int8 or float8_e4m3fn,
// worker/kv_quant.py) gets, per KV head, y = x - offset (keys: k_offset (KVH, d); values: none), the row's
// scale s = bf16(max(absmax(y), 2^-100) / qmax) into k_scale / v_scale (num_blocks, KVH, block_size)
// bfloat16 (a head's scales of a block contiguous), and the codes of y / s: the same float operations,
// saturation and roundings (to nearest even; c10's bfloat16 and e4m3 conversions) as torch's
// kv_quant.quantize, so the same bits.
// One position's rows of every KV head; its scales at kscale[j * head_stride] (head_stride: the block size).
template <typename T>
inline void store_codes(T* kdst, T* vdst, c10::BFloat16* kscale, c10::BFloat16* vscale, int64_t head_stride,
                        const float* keys, const float* values, const float* k_offset, int64_t num_kv_heads,
                        int64_t d) {
  for (int64_t j = 0; j < num_kv_heads; ++j) {
    store_row(kdst + j * d, kscale + j * head_stride, keys + j * d, k_offset + j * d, d);
    store_row(vdst + j * d, vscale + j * head_stride, values + j * d, nullptr, d);
  }
}

void norm_rotary_and_cache(at::Tensor& qkv, const float* q_weight, const float* k_weight, float eps,
                           const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                           const std::optional<at::Tensor>& k_offset) {
  check_rows(qkv, "rotary_and_cache");
  const int64_t T = qkv.size(0), d = k_cache.size(3);
  TORCH_CHECK(qkv.is_contiguous() && qkv.size(1) == (num_heads + 2 * num_kv_heads) * d && d % 2 == 0,
              "tpserve rotary_and_cache: qkv must be contiguous (T, (H + 2 KVH) d)");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.numel() == T * d && sin.numel() == T * d,
              "tpserve rotary_and_cache: cos and sin must be contiguous float32 (T, d)");
  const at::ScalarType cache_type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == cache_type &&
                  (cache_type == at::kFloat || cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn) &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == num_kv_heads,
              "tpserve rotary_and_cache: caches must be contiguous float32, int8 or float8_e4m3fn "
              "(num_blocks, block_size, KVH, d)");
  TORCH_CHECK((cache_type == at::kFloat) == (!k_scale.has_value() && !v_scale.has_value() && !k_offset.has_value()),
              "tpserve rotary_and_cache: an 8-bit cache takes k_scale, v_scale and k_offset, a float32 cache none");
  for (const std::optional<at::Tensor>* sc : {&k_scale, &v_scale}) {
    TORCH_CHECK(!sc->has_value() || ((*sc)->scalar_type() == at::kBFloat16 && (*sc)->is_contiguous() &&
                                     (*sc)->numel() == k_cache.size(0) * k_cache.size(1) * num_kv_heads),
                "tpserve rotary_and_cache: k_scale and v_scale must be contiguous bfloat16 (num_blocks, KVH, block_size)");
  }
  TORCH_CHECK(!k_offset.has_value() || (k_offset->scalar_type() == at::kFloat && k_offset->is_contiguous() &&
                                        k_offset->numel() == num_kv_heads * d && d <= 256),
              "tpserve rotary_and_cache: k_offset must be contiguous float32 (KVH, d), d <= 256");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "tpserve rotary_and_cache: slot_mapping must be int64 (T,)");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), width = qkv.size(1);
  const int64_t block_size = k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "tpserve rotary_and_cache: slot ", slots[t], " outside the cache");
  }
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const bool codes = cache_type != at::kFloat;
  char* kc = static_cast<char*>(k_cache.data_ptr());  // byte addresses: element size 4 or 1
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t element = codes ? 1 : static_cast<int64_t>(sizeof(float));
  c10::BFloat16* ks = codes ? k_scale->data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* vs = codes ? v_scale->data_ptr<c10::BFloat16>() : nullptr;
  const float* ko = codes ? k_offset->data_ptr<float>() : nullptr;
  const int64_t kv_floats = num_kv_heads * d, row_bytes = kv_floats * element;
  // A small row's cache lines (the embedded model: 4 a row) are asked for a few rows ahead, for
  // writing: the slots of a decode step lie all over the cache, mostly out of cache, and the copies
  // below would otherwise wait on each line in turn (one layer's call, 64 rows, torch.profiler: 23 -> 19 us).
  const int64_t ahead_lines = row_bytes <= 512 ? (row_bytes + 63) / 64 : 0;
  constexpr int64_t kAheadRows = 4;
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (t + kAheadRows < t1) {
        for (int64_t line = 0; line < ahead_lines; ++line) {
          __builtin_prefetch(kc + slots[t + kAheadRows] * row_bytes + 64 * line, 1, 3);
          __builtin_prefetch(vc + slots[t + kAheadRows] * row_bytes + 64 * line, 1, 3);
        }
      }
      float* row = qp + t * width;
      const float* c = cp + t * d;
      const float* s = sp + t * d;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        float* x = row + h * d;
        if (q_weight != nullptr) rms_norm_row(x, h < num_heads ? q_weight : k_weight, eps, d, x);  // in place
        rotate_half_head(x, c, s, d);
      }
      const float* keys = row + num_heads * d;
      const float* values = row + (num_heads + num_kv_heads) * d;
      char* kdst = kc + slots[t] * row_bytes;
      char* vdst = vc + slots[t] * row_bytes;
      if (cache_type == at::kFloat) {
        std::memcpy(kdst, keys, row_bytes);
        std::memcpy(vdst, values, row_bytes);
      } else {
        // The position's scale of head 0 in its block's (KVH, block_size) scales; head j's is block_size further.
        const int64_t at = (slots[t] / block_size * num_kv_heads) * block_size + slots[t] % block_size;
        if (cache_type == at::kChar) {
          store_codes(reinterpret_cast<int8_t*>(kdst), reinterpret_cast<int8_t*>(vdst), ks + at, vs + at, block_size,
                      keys, values, ko, num_kv_heads, d);
        } else {
          store_codes(reinterpret_cast<c10::Float8_e4m3fn*>(kdst), reinterpret_cast<c10::Float8_e4m3fn*>(vdst),
                      ks + at, vs + at, block_size, keys, values, ko, num_kv_heads, d);
        }
      }
    }
  });
}

void rotary_and_cache(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                      at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                      const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                      const std::optional<at::Tensor>& k_offset) {
  norm_rotary_and_cache(qkv, nullptr, nullptr, 0.0f, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                        num_kv_heads, k_scale, v_scale, k_offset);
}

// rotary_and_cache with each query head RMS-normalised by q_weight (d,) and each key head by k_weight (d,)
// first, as transformers' Qwen3Attention does (q_norm, k_norm before apply_rotary_pos_emb).
void qk_norm_rotary_and_cache(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight, double eps,
                              const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                              const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                              const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                              const std::optional<at::Tensor>& k_offset) {
  const int64_t d = k_cache.size(3);
  for (const at::Tensor* w : {&q_weight, &k_weight}) {
    TORCH_CHECK(w->is_contiguous() && w->scalar_type() == at::kFloat && w->numel() == d,
                "tpserve qk_norm_rotary_and_cache: q_weight and k_weight must be contiguous float32 (d,)");
  }
  norm_rotary_and_cache(qkv, q_weight.data_ptr<float>(), k_weight.data_ptr<float>(), static_cast<float>(eps), cos,
                        sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, k_scale, v_scale,
                        k_offset);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor residual, Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_and_cache(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads, Tensor? k_scale=None, Tensor? v_scale=None, "
        "Tensor? k_offset=None) -> ()");
  m.def("qk_norm_rotary_and_cache(Tensor(a!) qkv, Tensor q_weight, Tensor k_weight, float eps, Tensor cos, "
        "Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, int num_heads, "
        "int num_kv_heads, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? k_offset=None) -> ()");
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_and_cache", &rotary_and_cache);
  m.impl("qk_norm_rotary_and_cache", &qk_norm_rotary_and_cache);
}
