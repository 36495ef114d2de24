// A Llama decoder stack's decode step as one call from Python (two a layer with tensor parallelism).
//
// Why: the 95M benchmark model's decode step at batch 1 reads 380 MB of weights in about 15 ms,
// and spent another 2-3 ms around them: 30 layers of some 20 Python-level calls each (module
// calls, argument parsing, the dispatcher), for ops that compute in a few microseconds. llama.cpp
// runs the same step as one C++ graph. Here the layer (or each half of it) is one op that runs the
// same kernels as the Python path (cpu_elementwise, cpu_linear, cpu_attention) in the same order, so
// the results are bit-identical to it (tests/worker/test_decode_block.py); only the Python and
// dispatch between them is gone. The kernels are called through the dispatcher (about a
// microsecond each from C++), which keeps this file independent of the others' translation units.
//
// With tensor parallelism the op path keeps the all-reduces between the halves, in Python
// (worker/layers/decode_block.py):
//   attention_block: o = o_proj(paged_attention(rope([qk_norm](qkv_proj(rms_norm(h))))))   this rank's partial o
//   [all-reduce o; + o_proj's bias]
//   mlp_block:       h2 = h + o;  m = down_proj(silu(gate) * up), gate|up = gate_up_proj(rms_norm(h2))
//   [all-reduce m; + down_proj's bias];  h = h2 + m
// On one rank, DecodeLayers runs every layer of the step in one call: it keeps each layer's own
// arguments (weights, sizes), given once, and takes only the step's (h, RoPE, caches, slots, block
// tables) per call.
//
// Where every layer's projections are float32, int8, fp8 (up to 8 rows of x), group-wise 8-bit (up to 64) or int4
// (tiles; row-major up to 4 rows), DecodeLayers runs the step in one OpenMP parallel region instead
// (cpu_decode_region.cpp): the same functions,
// so the same bits, without the dispatch, allocation and fork/join between the ops. On a tensor-parallel rank
// (set_group: the host's shared-memory collectives) forward_tp does the same with the all-reduces inside the
// region, and where the region does not take a step returns an empty tensor: Python then runs the halves. Steps with
// adapter rows (forward_lora, forward_tp's row_slots) take the region where every layer's slots were given.
//
// With LoRA adapter slots (--enable-lora) each projection adds its adapters' low-rank sums for the
// step's adapter rows (lora_add_, cpu_lora.cpp) right after its GEMM, where the module path's
// linear layer adds them (worker/layers/linear.py). A step without adapter rows passes no
// row_slots and runs exactly the code above.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "decode_region.h"
#include "paged_attention.h"

#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>& linear_f32_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tpserve_cpu::linear_f32", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>();
  return op;
}

const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>& linear_w16_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tpserve_cpu::linear_w16", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>();
  return op;
}

const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const OptTensor&)>&
linear_int8_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("tpserve_cpu::linear_int8", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&)>();
  return op;
}

const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const OptTensor&)>&
linear_int4_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("tpserve_cpu::linear_int4", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&)>();
  return op;
}

const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const OptTensor&)>&
linear_fp8_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("tpserve_cpu::linear_fp8", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&)>();
  return op;
}

const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const OptTensor&)>&
linear_w8_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("tpserve_cpu::linear_w8", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&)>();
  return op;
}

// x (T, K) @ weight (N, K)^T [* scale] [+ bias] -> (T, N): the float32 or 16-bit float linear (no scale; bfloat16
// and float16 widened as read, linear_w16), or the int8, int4, grouped 8-bit or fp8 one (scale given; int4: a uint8 weight of packed codes, K / 2 columns, with its (N, K / G, 2) scales and offsets,
// cpu_linear_int4.cpp; grouped 8-bit: a uint8 weight of K columns, a code a byte, the same scales and offsets,
// cpu_linear_w8.cpp; fp8: float8_e4m3fn with (N, K / G) scales, cpu_linear_fp8.cpp).
at::Tensor project(const at::Tensor& x, const at::Tensor& weight, const OptTensor& scale, const OptTensor& bias) {
  if (scale.has_value() && weight.scalar_type() == at::kByte) {
    if (weight.size(1) == x.size(1)) return linear_w8_op().call(x, weight, *scale, bias);
    return linear_int4_op().call(x, weight, *scale, bias);
  }
  if (scale.has_value() && weight.scalar_type() == at::kFloat8_e4m3fn) return linear_fp8_op().call(x, weight, *scale, bias);
  if (scale.has_value()) return linear_int8_op().call(x, weight, *scale, bias);
  if (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf) {
    return linear_w16_op().call(x, weight, bias);  // a 16-bit layer widened as read: linear_f32's bits
  }
  return linear_f32_op().call(x, weight, bias);
}

// y (T, N) += each adapter row's (x @ A_s) @ B_s (row_slots (T,) int64, -1: no adapter), in place.
// part_widths: a fused layer's parts' output widths (q, k, v; gate, up), empty for one part.
void add_lora(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
              const at::Tensor& row_slots, at::IntArrayRef part_widths) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tpserve_cpu::lora_add_", "")
                             .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, at::IntArrayRef)>();
  op.call(y, x, lora_a, lora_b, row_slots, part_widths);
}

// The optional LoRA arguments of a block: all four pools given, or none (checked once here).
bool lora_given(const OptTensor& row_slots, const OptTensor& a0, const OptTensor& b0, const OptTensor& a1,
                const OptTensor& b1) {
  if (!row_slots.has_value()) return false;
  TORCH_CHECK(a0.has_value() && b0.has_value() && a1.has_value() && b1.has_value(),
              "tpserve decode block: lora_row_slots needs both projections' lora_a and lora_b");
  return true;
}

at::Tensor attention_block(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                           const at::Tensor& norm_weight, double eps, const at::Tensor& qkv_weight,
                           const OptTensor& qkv_scale, const OptTensor& qkv_bias, int64_t num_heads,
                           int64_t num_kv_heads, double scale, int64_t sliding_window, const at::Tensor& o_weight,
                           const OptTensor& o_scale, const OptTensor& q_norm_weight, const OptTensor& k_norm_weight,
                           double qk_norm_eps, const OptTensor& k_scale, const OptTensor& v_scale,
                           const OptTensor& k_offset, const OptTensor& lora_row_slots, const OptTensor& qkv_lora_a,
                           const OptTensor& qkv_lora_b, const OptTensor& o_lora_a, const OptTensor& o_lora_b,
                           at::IntArrayRef qkv_lora_parts) {
  static const auto rms_norm_op = c10::Dispatcher::singleton()
                                      .findSchemaOrThrow("tpserve_cpu::rms_norm", "")
                                      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  static const auto rotary_op = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("tpserve_cpu::rotary_and_cache", "")
                                    .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                                                at::Tensor&, const at::Tensor&, int64_t, int64_t, const OptTensor&,
                                                const OptTensor&, const OptTensor&)>();
  static const auto qk_norm_rotary_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("tpserve_cpu::qk_norm_rotary_and_cache", "")
          .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, double, const at::Tensor&, const at::Tensor&,
                      at::Tensor&, at::Tensor&, const at::Tensor&, int64_t, int64_t, const OptTensor&,
                      const OptTensor&, const OptTensor&)>();
  static const auto attention_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("tpserve_cpu::paged_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, double, int64_t, double, const OptTensor&,
                            const OptTensor&, const OptTensor&, const OptTensor&)>();
  const int64_t T = h.size(0), d = k_cache.size(3);
  const bool lora = lora_given(lora_row_slots, qkv_lora_a, qkv_lora_b, o_lora_a, o_lora_b);
  at::Tensor x = rms_norm_op.call(h, norm_weight, eps);            // (T, hidden)
  at::Tensor qkv = project(x, qkv_weight, qkv_scale, qkv_bias);    // (T, (H + 2 KVH) d)
  if (lora) add_lora(qkv, x, *qkv_lora_a, *qkv_lora_b, *lora_row_slots, qkv_lora_parts);  // + the adapters' q, k, v
  if (q_norm_weight.has_value()) {  // QK-norm (Qwen3): each q and k head RMS-normalised before the rotation
    qk_norm_rotary_op.call(qkv, *q_norm_weight, *k_norm_weight, qk_norm_eps, cos, sin, k_cache, v_cache,
                           slot_mapping, num_heads, num_kv_heads, k_scale, v_scale, k_offset);
  } else {
    rotary_op.call(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, k_scale, v_scale, k_offset);
  }  // q, k rotated; k, v cached
  at::Tensor q = qkv.narrow(1, 0, num_heads * d).view({T, num_heads, d});  // (T, H, d), rows strided
  at::Tensor o = attention_op.call(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                                   sliding_window, 0.0, std::nullopt, k_scale, v_scale,
                                   k_offset);  // (T, H, d); an 8-bit cache's codes read with their scales
  at::Tensor heads = o.view({T, num_heads * d});
  at::Tensor out = project(heads, o_weight, o_scale, std::nullopt);  // (T, hidden), partial over ranks
  if (lora) add_lora(out, heads, *o_lora_a, *o_lora_b, *lora_row_slots, {});  // A split by columns: partial too
  return out;
}

std::tuple<at::Tensor, at::Tensor> mlp_block(const at::Tensor& h, const at::Tensor& o, const at::Tensor& norm_weight,
                                             double eps, const at::Tensor& gate_up_weight,
                                             const OptTensor& gate_up_scale, const OptTensor& gate_up_bias,
                                             const at::Tensor& down_weight, const OptTensor& down_scale,
                                             const OptTensor& lora_row_slots, const OptTensor& gate_up_lora_a,
                                             const OptTensor& gate_up_lora_b, const OptTensor& down_lora_a,
                                             const OptTensor& down_lora_b, at::IntArrayRef gate_up_lora_parts) {
  static const auto add_rms_norm_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("tpserve_cpu::add_rms_norm", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  static const auto silu_and_mul_op = c10::Dispatcher::singleton()
                                          .findSchemaOrThrow("tpserve_cpu::silu_and_mul", "")
                                          .typed<at::Tensor(const at::Tensor&)>();
  const bool lora = lora_given(lora_row_slots, gate_up_lora_a, gate_up_lora_b, down_lora_a, down_lora_b);
  auto [h2, x] = add_rms_norm_op.call(h, o, norm_weight, eps);                     // h + o, and its norm: (T, hidden)
  at::Tensor gate_up = project(x, gate_up_weight, gate_up_scale, gate_up_bias);   // (T, 2 intermediate)
  if (lora) add_lora(gate_up, x, *gate_up_lora_a, *gate_up_lora_b, *lora_row_slots, gate_up_lora_parts);
  at::Tensor act = silu_and_mul_op.call(gate_up);                                 // (T, intermediate)
  at::Tensor m = project(act, down_weight, down_scale, std::nullopt);             // (T, hidden)
  if (lora) add_lora(m, act, *down_lora_a, *down_lora_b, *lora_row_slots, {});   // partial over ranks too
  return {h2, m};
}

// A layer's own arguments: weights, scales and biases (None where the layer has none), sizes.
struct LayerArgs {
  at::Tensor norm1_weight;
  double eps1;
  at::Tensor qkv_weight;
  OptTensor qkv_scale, qkv_bias;
  int64_t num_heads, num_kv_heads;
  double scale;
  int64_t sliding_window;
  at::Tensor o_weight;
  OptTensor o_scale, q_norm_weight, k_norm_weight;
  double qk_norm_eps;
  OptTensor o_bias;
  at::Tensor norm2_weight;
  double eps2;
  at::Tensor gate_up_weight;
  OptTensor gate_up_scale, gate_up_bias;
  at::Tensor down_weight;
  OptTensor down_scale, down_bias;
  OptTensor qkv_lora_a, qkv_lora_b, o_lora_a, o_lora_b, gate_up_lora_a, gate_up_lora_b, down_lora_a, down_lora_b;
  std::vector<int64_t> qkv_lora_parts, gate_up_lora_parts;
};

// One rank holds the whole layer (no all-reduce): both halves and the residual adds. The row-parallel
// biases are added where the module path adds them, after the (here absent) sum over ranks.
at::Tensor decoder_layer(const LayerArgs& L, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                         const at::Tensor& context_lens, const OptTensor& k_scale, const OptTensor& v_scale,
                         const OptTensor& k_offset, const OptTensor& lora_row_slots) {
  at::Tensor o = attention_block(h, cos, sin, k_cache, v_cache, slot_mapping, block_tables, query_start_loc,
                                 context_lens, L.norm1_weight, L.eps1, L.qkv_weight, L.qkv_scale, L.qkv_bias,
                                 L.num_heads, L.num_kv_heads, L.scale, L.sliding_window, L.o_weight,
                                 L.o_scale, L.q_norm_weight, L.k_norm_weight, L.qk_norm_eps, k_scale, v_scale,
                                 k_offset, lora_row_slots, L.qkv_lora_a, L.qkv_lora_b, L.o_lora_a, L.o_lora_b,
                                 L.qkv_lora_parts);  // (T, hidden)
  if (L.o_bias.has_value()) o = at::add(o, *L.o_bias);
  auto [h2, m] = mlp_block(h, o, L.norm2_weight, L.eps2, L.gate_up_weight, L.gate_up_scale, L.gate_up_bias,
                           L.down_weight, L.down_scale, lora_row_slots, L.gate_up_lora_a, L.gate_up_lora_b,
                           L.down_lora_a, L.down_lora_b, L.gate_up_lora_parts);
  if (L.down_bias.has_value()) m = at::add(m, *L.down_bias);
  return at::add(h2, m);  // (T, hidden)
}

}  // namespace

namespace tpserve {

// Every layer of a stack (one rank's, a pipeline stage's, or with set_group a tensor-parallel rank's), for a whole
// decode step in one call from Python: the layers' own arguments are given once (add_layer, in layer order), each
// step brings only its own (forward; forward_tp). Python: torch.classes.tpserve_cpu.DecodeLayers
// (worker/layers/decode_block.py). With --enable-lora, add_lora gives a layer's adapter slots once and
// forward_lora (or forward_tp's row_slots) runs a step that has adapter rows.
class DecodeLayers : public torch::CustomClassHolder {
 public:
  void add_layer(at::Tensor norm1_weight, double eps1, at::Tensor qkv_weight, OptTensor qkv_scale,
                 OptTensor qkv_bias, int64_t num_heads, int64_t num_kv_heads, double scale, int64_t sliding_window,
                 at::Tensor o_weight, OptTensor o_scale, OptTensor q_norm_weight, OptTensor k_norm_weight,
                 double qk_norm_eps, OptTensor o_bias, at::Tensor norm2_weight, double eps2,
                 at::Tensor gate_up_weight, OptTensor gate_up_scale, OptTensor gate_up_bias, at::Tensor down_weight,
                 OptTensor down_scale, OptTensor down_bias) {
    layers_.push_back({std::move(norm1_weight), eps1, std::move(qkv_weight), std::move(qkv_scale),
                       std::move(qkv_bias), num_heads, num_kv_heads, scale, sliding_window, std::move(o_weight),
                       std::move(o_scale), std::move(q_norm_weight), std::move(k_norm_weight), qk_norm_eps,
                       std::move(o_bias), std::move(norm2_weight), eps2,
                       std::move(gate_up_weight), std::move(gate_up_scale), std::move(gate_up_bias),
                       std::move(down_weight), std::move(down_scale), std::move(down_bias)});
    add_region_layer(layers_.back());
  }

  // Layer `layer`'s adapter slots (A (L, P*R, K), B (L, P*R, N) per projection, cpu_lora.cpp; the fused
  // qkv and gate_up layers' parts' widths), kept by
  // reference: an adapter loaded into the pools later is seen by the next step.
  void add_lora(int64_t layer, at::Tensor qkv_a, at::Tensor qkv_b, at::Tensor o_a, at::Tensor o_b,
                at::Tensor gate_up_a, at::Tensor gate_up_b, at::Tensor down_a, at::Tensor down_b,
                std::vector<int64_t> qkv_parts, std::vector<int64_t> gate_up_parts) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "tpserve DecodeLayers.add_lora: layer ",
                layer, " of ", layers_.size());
    LayerArgs& L = layers_[layer];
    L.qkv_lora_a = std::move(qkv_a), L.qkv_lora_b = std::move(qkv_b);
    L.o_lora_a = std::move(o_a), L.o_lora_b = std::move(o_b);
    L.gate_up_lora_a = std::move(gate_up_a), L.gate_up_lora_b = std::move(gate_up_b);
    L.down_lora_a = std::move(down_a), L.down_lora_b = std::move(down_b);
    L.qkv_lora_parts = std::move(qkv_parts), L.gate_up_lora_parts = std::move(gate_up_parts);
    add_region_lora(layer);
  }

  // h (T, hidden) through every layer -> (T, hidden); layer i's keys and values go to k_caches[i], v_caches[i].
  // kv_scales: empty for float32 caches; for 8-bit ones layer i's k_scale, v_scale, k_offset at 3i .. 3i + 2
  // (worker/kv_quant.py).
  at::Tensor forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, std::vector<at::Tensor> k_caches,
                     std::vector<at::Tensor> v_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                     std::vector<at::Tensor> kv_scales) {
    return run(std::move(h), cos, sin, k_caches, v_caches, slot_mapping, block_tables, query_start_loc,
               context_lens, kv_scales, std::nullopt);
  }

  // Tensor parallelism on one host: the group's shared-memory segment as worker/comm/shm_allreduce.py maps it
  // (its address in this process, this rank, the ranks, bytes per slot, its spin, sleep and timeout seconds,
  // each rank's pid or none), given once; forward_tp then runs a step with the group.
  void set_group(int64_t base, int64_t rank, int64_t world, int64_t max_bytes, double spin_s, double sleep_s,
                 double timeout_s, std::vector<int64_t> peer_pids) {
    TORCH_CHECK(world >= 2 && 0 <= rank && rank < world && max_bytes > 0 &&
                    (peer_pids.empty() || static_cast<int64_t>(peer_pids.size()) == world),
                "tpserve DecodeLayers.set_group: rank ", rank, " of ", world, ", ", peer_pids.size(), " pids");
    group_ = tpserve::ShmGroup{base, rank, world, max_bytes, spin_s, sleep_s, timeout_s, std::move(peer_pids)};
  }

  // forward on a tensor-parallel rank (set_group): every layer in the parallel region, each half's partial
  // product summed over the ranks by collectives first_seq, first_seq + 1, .. (two a layer); h (T, hidden) ->
  // (T, hidden). Where the region does not take the step (its rows, formats or tensors), an empty tensor and no
  // collective: the caller runs the layers' halves instead. Raises the collective's error (a peer exited, the
  // timeout passed) as a RuntimeError.
  at::Tensor forward_tp(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, std::vector<at::Tensor> k_caches,
                        std::vector<at::Tensor> v_caches, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                        const at::Tensor& context_lens, std::vector<at::Tensor> kv_scales, int64_t first_seq,
                        const OptTensor& row_slots) {
    TORCH_CHECK(group_.has_value(), "tpserve DecodeLayers.forward_tp: set_group first");
    check_sizes(k_caches, v_caches, kv_scales);
    if (h.dim() != 2 || h.numel() * static_cast<int64_t>(sizeof(float)) > group_->max_bytes ||
        !region_lora_takes(h, row_slots) ||
        !region_takes(h, cos, sin, k_caches, v_caches, kv_scales, slot_mapping, block_tables, query_start_loc,
                      context_lens)) {
      return at::empty({0}, h.options());
    }
    return run_region(h, cos, sin, k_caches, v_caches, slot_mapping, block_tables, query_start_loc, context_lens,
                      kv_scales, &*group_, first_seq, row_slots);
  }

  // Whether the stack's layers could run in the region at all (their formats and shapes): false keeps every
  // step on the ops, which a tensor-parallel rank then runs as halves around its all-reduces.
  bool region_ready() const { return region_ok_ && region_.size() == layers_.size() && !layers_.empty(); }

  // forward for a step with adapter rows: row_slots (T,) int64, each row's slot index (-1: the base model).
  at::Tensor forward_lora(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, std::vector<at::Tensor> k_caches,
                          std::vector<at::Tensor> v_caches, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                          const at::Tensor& context_lens, std::vector<at::Tensor> kv_scales,
                          const at::Tensor& row_slots) {
    for (const LayerArgs& L : layers_) {
      TORCH_CHECK(L.qkv_lora_a.has_value(), "tpserve DecodeLayers.forward_lora: a layer has no add_lora");
    }
    return run(std::move(h), cos, sin, k_caches, v_caches, slot_mapping, block_tables, query_start_loc,
               context_lens, kv_scales, row_slots);
  }

 private:
  at::Tensor run(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, std::vector<at::Tensor>& k_caches,
                 std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                 const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                 const std::vector<at::Tensor>& kv_scales, const OptTensor& row_slots) {
    check_sizes(k_caches, v_caches, kv_scales);
    if (region_lora_takes(h, row_slots) && region_takes(h, cos, sin, k_caches, v_caches, kv_scales, slot_mapping,
                                                         block_tables, query_start_loc, context_lens)) {
      return run_region(h, cos, sin, k_caches, v_caches, slot_mapping, block_tables, query_start_loc, context_lens,
                        kv_scales, nullptr, 0, row_slots);
    }
    for (size_t i = 0; i < layers_.size(); ++i) {
      const bool codes = !kv_scales.empty();
      h = decoder_layer(layers_[i], h, cos, sin, k_caches[i], v_caches[i], slot_mapping, block_tables,
                        query_start_loc, context_lens, codes ? OptTensor(kv_scales[3 * i]) : std::nullopt,
                        codes ? OptTensor(kv_scales[3 * i + 1]) : std::nullopt,
                        codes ? OptTensor(kv_scales[3 * i + 2]) : std::nullopt, row_slots);
    }
    return h;
  }

  void check_sizes(const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                   const std::vector<at::Tensor>& kv_scales) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size() &&
                    (kv_scales.empty() || kv_scales.size() == 3 * layers_.size()),
                "tpserve DecodeLayers: ", layers_.size(), " layers, ", k_caches.size(), " key and ", v_caches.size(),
                " value caches, ", kv_scales.size(), " scale tensors");
  }

  // The step in the parallel region (region_takes said yes); group: null at one rank.
  at::Tensor run_region(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                        const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                        const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                        const std::vector<at::Tensor>& kv_scales, const tpserve::ShmGroup* group, int64_t first_seq,
                        const OptTensor& row_slots) {
    at::Tensor out = at::empty_like(h);
    const at::ScalarType cache_type = k_caches[0].scalar_type();
    const auto kind = cache_type == at::kFloat  ? tpserve::RegionStep::kFloat32
                      : cache_type == at::kChar ? tpserve::RegionStep::kInt8
                                                : tpserve::RegionStep::kFp8;
    tpserve::RegionStep step{kind, h.data_ptr<float>(), out.data_ptr<float>(), h.size(0), h.size(1),
                             k_caches[0].size(3), cos.data_ptr<float>(), sin.data_ptr<float>(), {}, {}, {}, {}, {},
                             k_caches[0].size(1), slot_mapping.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(),
                             block_tables.size(1), query_start_loc.data_ptr<int64_t>(),
                             context_lens.data_ptr<int64_t>(), context_lens.numel(), group, first_seq,
                             row_slots.has_value() ? row_slots->data_ptr<int64_t>() : nullptr};
    for (size_t i = 0; i < layers_.size(); ++i) {
      step.k_caches.push_back(k_caches[i].data_ptr());
      step.v_caches.push_back(v_caches[i].data_ptr());
      if (!kv_scales.empty()) {
        step.k_scales.push_back(kv_scales[3 * i].data_ptr());
        step.v_scales.push_back(kv_scales[3 * i + 1].data_ptr());
        step.k_offsets.push_back(kv_scales[3 * i + 2].data_ptr<float>());
      }
    }
    const std::string error = tpserve::decode_region(region_, step);
    TORCH_CHECK(error.empty(), error);
    return out;
  }

  // Whether the region can take this step's adapter rows: none, or every layer's slots given (add_lora) and the
  // rows' slot indices an int64 (T,) tensor within the pools (lora_add_'s check, made once for the step).
  bool region_lora_takes(const at::Tensor& h, const OptTensor& row_slots) const {
    if (!row_slots.has_value()) return true;
    if (region_.size() != layers_.size() || region_.empty() || h.dim() != 2 ||
        row_slots->scalar_type() != at::kLong || !row_slots->is_contiguous() || row_slots->numel() != h.size(0)) {
      return false;
    }
    for (const tpserve::RegionLayer& L : region_) {
      if (!L.lora) return false;
    }
    const int64_t* slots = row_slots->data_ptr<int64_t>();
    const int64_t num_slots = region_[0].qkv_lora.L;
    for (int64_t t = 0; t < h.size(0); ++t) {
      TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "tpserve lora_add_: row ", t, " has slot index ", slots[t],
                  " outside [-1, ", num_slots, ")");
    }
    return true;
  }

  // Layer `layer`'s adapter slots in the region's terms, where its pools are what lora_add_ takes (contiguous
  // float32, one pool size for the four projections); else the layer's steps with adapter rows keep the ops.
  void add_region_lora(int64_t layer) {
    if (!region_ok_ || layer >= static_cast<int64_t>(region_.size())) return;
    const LayerArgs& L = layers_[layer];
    tpserve::RegionLayer& R = region_[layer];
    auto slots = [](const OptTensor& a, const OptTensor& b, int64_t K, int64_t N,
                    const std::vector<int64_t>& parts) -> std::optional<tpserve::LoraSlots> {
      if (!a.has_value() || !b.has_value() || a->scalar_type() != at::kFloat || b->scalar_type() != at::kFloat ||
          !a->is_contiguous() || !b->is_contiguous() || a->dim() != 3 || b->dim() != 3 || a->size(2) != K ||
          b->size(2) != N || a->size(0) != b->size(0) || a->size(1) != b->size(1)) {
        return std::nullopt;
      }
      std::vector<int64_t> widths = parts.empty() ? std::vector<int64_t>{N} : parts;
      int64_t sum = 0;
      for (int64_t w : widths) sum += w;
      if (sum != N || a->size(1) % static_cast<int64_t>(widths.size()) != 0) return std::nullopt;
      return tpserve::LoraSlots{a->data_ptr<float>(), b->data_ptr<float>(), a->size(0), a->size(1), widths};
    };
    const auto qkv = slots(L.qkv_lora_a, L.qkv_lora_b, R.qkv.K, R.qkv.N, L.qkv_lora_parts);
    const auto o = slots(L.o_lora_a, L.o_lora_b, R.o.K, R.o.N, {});
    const auto gate_up = slots(L.gate_up_lora_a, L.gate_up_lora_b, R.gate_up.K, R.gate_up.N, L.gate_up_lora_parts);
    const auto down = slots(L.down_lora_a, L.down_lora_b, R.down.K, R.down.N, {});
    R.lora = qkv && o && gate_up && down && qkv->L == o->L && qkv->L == gate_up->L && qkv->L == down->L;
    if (R.lora) R.qkv_lora = *qkv, R.o_lora = *o, R.gate_up_lora = *gate_up, R.down_lora = *down;
  }

  // The layer in the region's terms (decode_region.h) where every projection is float32, 16-bit float, int8, fp8,
  // group-wise 8-bit or int4 and its other tensors are contiguous float32; else region_ok_ turns false for the stack.
  void add_region_layer(const LayerArgs& L) {
    using tpserve::RegionWeight;
    // K: the projection's input width (x's columns), which tells int4's codes (K / 2 a row) from grouped 8-bit's.
    auto weight = [](const at::Tensor& w, const OptTensor& scale, const OptTensor& bias,
                     int64_t K) -> std::optional<RegionWeight> {
      if (w.dim() != 2 || !w.is_contiguous() || (scale.has_value() && (scale->scalar_type() != at::kFloat ||
                                                                       !scale->is_contiguous()))) {
        return std::nullopt;
      }
      if (bias.has_value() && (bias->scalar_type() != at::kFloat || !bias->is_contiguous() ||
                               bias->numel() != w.size(0))) {
        return std::nullopt;
      }
      const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
      const int64_t N = w.size(0);
      if (w.scalar_type() == at::kFloat && !scale.has_value()) {  // project(): linear_f32
        return RegionWeight{RegionWeight::kFloat32, w.data_ptr<float>(), nullptr, b, N, w.size(1), 0};
      }
      if ((w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf) && !scale.has_value()) {  // linear_w16
        const auto kind = w.scalar_type() == at::kBFloat16 ? RegionWeight::kBf16 : RegionWeight::kF16;
        return RegionWeight{kind, w.data_ptr(), nullptr, b, N, w.size(1), 0};
      }
      if (w.scalar_type() == at::kChar && scale.has_value() && scale->numel() == N) {  // linear_int8
        return RegionWeight{RegionWeight::kInt8, w.data_ptr<int8_t>(), scale->data_ptr<float>(), b, N, w.size(1), 0};
      }
      if (w.scalar_type() == at::kFloat8_e4m3fn && scale.has_value() && scale->dim() == 2 && scale->size(0) == N &&
          w.size(1) == K && scale->size(1) >= 1 && K % scale->size(1) == 0) {  // linear_fp8
        return RegionWeight{RegionWeight::kFp8, w.data_ptr(), scale->data_ptr<float>(), b, N, K, K / scale->size(1)};
      }
      if (w.scalar_type() == at::kByte && scale.has_value() && w.size(1) == K && scale->dim() == 3 &&
          scale->size(0) == N && scale->size(2) == 2 && scale->size(1) >= 1 && K % scale->size(1) == 0) {
        return RegionWeight{RegionWeight::kW8, w.data_ptr<uint8_t>(), scale->data_ptr<float>(), b, N, K,
                            K / scale->size(1)};  // linear_w8: group-wise 8-bit, a byte a code
      }
      if (w.scalar_type() != at::kByte || !scale.has_value() || w.size(1) * 2 != K || scale->dim() < 3 ||
          scale->size(1) < 1 || K % scale->size(1) != 0) {
        return std::nullopt;
      }
      const int64_t G = K / scale->size(1);
      if (scale->dim() == 4 && scale->size(0) * 16 == N) {  // linear_int4 over the tile layout
        return RegionWeight{RegionWeight::kInt4Tiles, w.data_ptr<uint8_t>(), scale->data_ptr<float>(), b, N, K, G};
      }
      if (scale->dim() == 3 && scale->size(0) == N && scale->size(2) == 2) {  // the row-major layout
        return RegionWeight{RegionWeight::kInt4Rows, w.data_ptr<uint8_t>(), scale->data_ptr<float>(), b, N, K, G};
      }
      return std::nullopt;
    };
    auto floats = [](const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.is_contiguous(); };
    const int64_t hidden = L.norm1_weight.numel(), heads = L.num_heads + 2 * L.num_kv_heads;
    const int64_t head_dim = L.qkv_weight.size(0) / heads;
    const auto qkv = weight(L.qkv_weight, L.qkv_scale, L.qkv_bias, hidden);
    const auto o = weight(L.o_weight, L.o_scale, L.o_bias, L.num_heads * head_dim);
    const auto gate_up = weight(L.gate_up_weight, L.gate_up_scale, L.gate_up_bias, hidden);
    const auto down = weight(L.down_weight, L.down_scale, L.down_bias, L.gate_up_weight.size(0) / 2);
    const int64_t d = qkv ? qkv->N / heads : 0;
    const bool qk_norm = L.q_norm_weight.has_value();
    if (qk_norm && !(L.k_norm_weight.has_value() && floats(*L.q_norm_weight) && floats(*L.k_norm_weight) &&
                     L.q_norm_weight->numel() == d && L.k_norm_weight->numel() == d)) {
      region_ok_ = false;
      return;
    }
    if (!region_ok_ || !qkv || !o || !gate_up || !down || !floats(L.norm1_weight) ||
        !floats(L.norm2_weight) || L.num_heads % L.num_kv_heads != 0 || qkv->N % heads != 0 || qkv->K != hidden ||
        o->N != hidden || o->K != L.num_heads * (qkv->N / heads) || gate_up->K != hidden || gate_up->N % 2 != 0 ||
        down->K != gate_up->N / 2 || down->N != hidden ||
        (!region_.empty() && (region_[0].num_kv_heads != L.num_kv_heads || region_[0].num_heads != L.num_heads ||
                              region_[0].qkv.N != qkv->N))) {
      region_ok_ = false;
      return;
    }
    region_.push_back({L.norm1_weight.data_ptr<float>(), static_cast<float>(L.eps1), *qkv, *o,
                       L.norm2_weight.data_ptr<float>(), static_cast<float>(L.eps2), *gate_up, *down, L.num_heads,
                       L.num_kv_heads, qk_norm ? L.q_norm_weight->data_ptr<float>() : nullptr,
                       qk_norm ? L.k_norm_weight->data_ptr<float>() : nullptr, static_cast<float>(L.qk_norm_eps),
                       static_cast<float>(L.scale), L.sliding_window});
  }

  // Whether this step takes the region: every layer could at this many rows, it is switched on, and the step's
  // tensors are a float32 or 8-bit cache's decode rows that the ops would accept (the same checks, made once for
  // the stack).
  bool region_takes(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                    const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                    const std::vector<at::Tensor>& kv_scales, const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                    const at::Tensor& context_lens) const {
    if (!region_ok_ || region_.size() != layers_.size() || layers_.empty() || !tpserve::decode_region_enabled() ||
        h.dim() != 2 || !tpserve::decode_region_takes_rows(region_, h.size(0))) {
      return false;
    }
    const tpserve::RegionLayer& L = region_[0];
    const int64_t T = h.size(0), d = L.qkv.N / (L.num_heads + 2 * L.num_kv_heads);
    auto ints = [](const at::Tensor& t) { return t.scalar_type() == at::kLong && t.is_contiguous(); };
    if (h.scalar_type() != at::kFloat || h.dim() != 2 || !h.is_contiguous() || h.size(1) != L.qkv.K || T < 1 ||
        cos.scalar_type() != at::kFloat || sin.scalar_type() != at::kFloat || !cos.is_contiguous() ||
        !sin.is_contiguous() || cos.numel() != T * d || sin.numel() != T * d ||
        !tpserve::paged_attention_head_size(d) || !ints(slot_mapping) || slot_mapping.numel() != T ||
        !ints(block_tables) || block_tables.dim() != 2 || !ints(query_start_loc) || !ints(context_lens) ||
        query_start_loc.numel() != context_lens.numel() + 1 || block_tables.size(0) != context_lens.numel()) {
      return false;
    }
    const at::ScalarType cache_type = k_caches[0].scalar_type();
    const bool codes = cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn;
    if ((cache_type != at::kFloat && !codes) || kv_scales.size() != (codes ? 3 * layers_.size() : 0) || d > 256) {
      return false;
    }
    for (size_t i = 0; i < layers_.size(); ++i) {
      const at::Tensor &k = k_caches[i], &v = v_caches[i];
      if (k.scalar_type() != cache_type || v.scalar_type() != cache_type || !k.is_contiguous() || !v.is_contiguous() ||
          k.dim() != 4 || k.sizes() != v.sizes() || k.size(2) != L.num_kv_heads || k.size(3) != d ||
          k.size(1) != k_caches[0].size(1)) {
        return false;
      }
      if (!codes) continue;
      for (const at::Tensor& scale : {kv_scales[3 * i], kv_scales[3 * i + 1]}) {  // (num_blocks, KVH, block_size)
        if (scale.scalar_type() != at::kBFloat16 || !scale.is_contiguous() || scale.dim() != 3 ||
            scale.size(0) != k.size(0) || scale.size(1) != k.size(2) || scale.size(2) != k.size(1)) {
          return false;
        }
      }
      const at::Tensor& offset = kv_scales[3 * i + 2];  // (KVH, d)
      if (offset.scalar_type() != at::kFloat || !offset.is_contiguous() || offset.numel() != L.num_kv_heads * d) {
        return false;
      }
    }
    // What the ops check of the step (rotary_and_cache: slots; paged_attention: rows and context lengths).
    const int64_t num_slots = k_caches[0].size(0) * k_caches[0].size(1), S = context_lens.numel();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "tpserve rotary_and_cache: slot ", slots[t],
                  " outside the cache");
    }
    const int64_t* starts = query_start_loc.data_ptr<int64_t>();
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    const int64_t capacity = block_tables.size(1) * k_caches[0].size(1);
    TORCH_CHECK(starts[0] == 0 && starts[S] == T, "tpserve paged_attention: query_start_loc must run from 0 to ", T);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t n = starts[s + 1] - starts[s];
      TORCH_CHECK(n >= 1 && lens[s] >= n && lens[s] <= capacity, "tpserve paged_attention: sequence ", s, " has ", n,
                  " query rows and context length ", lens[s], " (its block table holds ", capacity, ")");
    }
    return true;
  }

  std::vector<LayerArgs> layers_;
  std::vector<tpserve::RegionLayer> region_;  // the layers in the region's terms, while region_ok_
  bool region_ok_ = true;
  std::optional<tpserve::ShmGroup> group_;  // set_group: a tensor-parallel rank's
};

}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.def("attention_block(Tensor h, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor context_lens, Tensor norm_weight, "
        "float eps, Tensor qkv_weight, Tensor? qkv_scale, Tensor? qkv_bias, int num_heads, int num_kv_heads, "
        "float scale, int sliding_window, Tensor o_weight, Tensor? o_scale, Tensor? q_norm_weight, "
        "Tensor? k_norm_weight, float qk_norm_eps, Tensor? k_scale=None, Tensor? v_scale=None, "
        "Tensor? k_offset=None, Tensor? lora_row_slots=None, Tensor? qkv_lora_a=None, Tensor? qkv_lora_b=None, "
        "Tensor? o_lora_a=None, Tensor? o_lora_b=None, int[] qkv_lora_parts=[]) -> Tensor");
  m.def("mlp_block(Tensor h, Tensor o, Tensor norm_weight, float eps, Tensor gate_up_weight, "
        "Tensor? gate_up_scale, Tensor? gate_up_bias, Tensor down_weight, Tensor? down_scale, "
        "Tensor? lora_row_slots=None, Tensor? gate_up_lora_a=None, Tensor? gate_up_lora_b=None, "
        "Tensor? down_lora_a=None, Tensor? down_lora_b=None, int[] gate_up_lora_parts=[]) -> (Tensor, Tensor)");
  m.class_<tpserve::DecodeLayers>("DecodeLayers")
      .def(torch::init<>())
      .def("add_layer", &tpserve::DecodeLayers::add_layer)
      .def("add_lora", &tpserve::DecodeLayers::add_lora)
      .def("forward", &tpserve::DecodeLayers::forward)
      .def("forward_lora", &tpserve::DecodeLayers::forward_lora)
      .def("set_group", &tpserve::DecodeLayers::set_group)
      .def("forward_tp", &tpserve::DecodeLayers::forward_tp)
      .def("region_ready", &tpserve::DecodeLayers::region_ready);
}

TORCH_LIBRARY_IMPL(tpserve_cpu, CPU, m) {
  m.impl("attention_block", &attention_block);
  m.impl("mlp_block", &mlp_block);
}
