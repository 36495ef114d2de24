"""MiniMax-M2 (``MiniMaxM2ForCausalLM``): full-width QK-norm, partial RoPE, sigmoid-routed experts in every layer.

Reference: ``transformers``' ``modeling_minimax_m2.py``. For a flat batch of ``T`` tokens on one rank:

    h = embed(input_ids)
    for each layer:
        q, k, v = qkv_proj(rms_norm(h))                     no bias anywhere
        q, k = q_norm(q), k_norm(k)                         RMSNorm over ALL heads' q (k) together:
                                                            worker/layers/qk_norm.py (one all-reduce at tp > 1)
        q, k = rope(q[..., :r]) ++ q[..., r:], ...          partial RoPE, r = ``rotary_dim`` of ``head_dim``
        h = h + o_proj(attention(q, k, v))
        h = h + moe(rms_norm(h))                            one all-reduce
                 ids = top-k of sigmoid(router(x)) + e_score_correction_bias   (one group)
                 moe(x) = sum_j w_j * expert_{ids_j}(x),  w = sigmoid scores of ids, renormalised
    h = rms_norm(h); logits = lm_head(h)

The router's logits are computed in the model dtype (``transformers`` runs the router GEMM in
its weight's dtype) and scored in float32; the routing weights stay float32; there are no
shared experts and no scaling (worker/layers/moe_routing.py). Config keys read here:
``num_local_experts``, ``num_experts_per_tok``; the expert width is ``intermediate_size``;
``rotary_dim`` is :class:`ModelConfig`'s. Checkpoint names: ``self_attn.q_norm.weight``
``(H * d,)``, ``self_attn.k_norm.weight`` ``(KVH * d,)``; under ``block_sparse_moe.``:
``gate.weight``, ``e_score_correction_bias`` and ``experts.{e}.w1/w3/w2.weight`` (gate/up/down),
held here under ``mlp.`` with the bias in the router (``mlp.gate.e_score_correction_bias``).
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata
from worker.layers.qk_norm import FullWidthRMSNorm, full_width_qk_norm
from worker.layers.moe import MIXTRAL_EXPERT_NAMES, SparseMoeBlock, expert_checkpoint_name, expert_weight_map
from worker.layers.moe_routing import BiasedRouting, BiasedTopKRouter
from worker.layers.partial_rotary import rotate_partial_and_cache
from worker.layers.rotary import rotate_and_cache
from worker.models.base import KVCache, ShardId
from worker.models.llama import Biases, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, Rope
from worker.parallel_state import ParallelContext

_CHECKPOINT_BLOCK, _BLOCK = ".block_sparse_moe.", ".mlp."
_CHECKPOINT_BIAS, _BIAS = ".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"


class MiniMaxM2Attention(LlamaAttention):
    """Llama attention (no bias) with full-width QK-norm before a partial rotation."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None, *, sliding_window: int | None = None) -> None:
        super().__init__(config, ctx, dtype, quantization, Biases(), sliding_window=sliding_window)
        d = config.head_dim
        self.ctx, self.eps, self.rotary_dim = ctx, config.rms_norm_eps, config.rotary_dim
        eps = config.rms_norm_eps
        self.q_norm = FullWidthRMSNorm(config.total_num_heads * d, ctx.tp_rank * self.q_size, self.q_size, eps,
                                       dtype=dtype, device=ctx.device, cast_before_weight=True)
        self.k_norm = FullWidthRMSNorm(config.total_num_kv_heads * d, self.qkv_proj.kv_head_start * d, self.kv_size,
                                       eps, dtype=dtype, device=ctx.device, cast_before_weight=True)

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (T, (num_heads + 2 * num_kv_heads) * d)
        qkv = full_width_qk_norm(qkv, self.q_norm, self.k_norm, self.ctx)
        if self.rotary_dim is None:
            q, k, v = rotate_and_cache(qkv, *rope, *kv_cache, attn_metadata.slot_mapping, self.num_heads,
                                       self.num_kv_heads, kv_scales=self.attn.kv_scales)
        else:
            q, k, v = rotate_partial_and_cache(qkv, *rope, *kv_cache, attn_metadata.slot_mapping, self.num_heads,
                                               self.num_kv_heads, self.rotary_dim, kv_scales=self.attn.kv_scales)
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (T, num_heads * d)
        return self.o_proj(o)  # (T, hidden), all-reduced over ranks


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    """MiniMax-M2: :class:`MiniMaxM2Attention` and a sigmoid-routed :class:`SparseMoeBlock` in every layer.

    Raises:
        ValueError: a bad expert count (named), ``hidden_act`` not silu, or ``--quantization``.
    """

    @classmethod
    def biases(cls, config: ModelConfig) -> Biases:
        return Biases()

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        num_experts = config.hf_value("num_local_experts", 256)
        # One group, always renormalised (no epsilon), unscaled; logits in the model dtype.
        routing = BiasedRouting(top_k=config.hf_value("num_experts_per_tok", 8), norm_eps=0.0,
                                logits_in_float32=False)
        router = BiasedTopKRouter(config.hidden_size, num_experts, routing, ctx, dtype)
        moe = SparseMoeBlock(config.hidden_size, num_experts, routing.top_k, config.intermediate_size, ctx, dtype,
                             renormalize=True, weights_in_dtype=False, quantization=quantization, router=router)
        attention = MiniMaxM2Attention(config, ctx, dtype, quantization,
                                       sliding_window=config.layer_sliding_window(layer_index))
        return LlamaDecoderLayer(config, ctx, dtype, attention, moe)

    def weight_map(self, checkpoint_name: str) -> tuple[str, ShardId] | None:
        name = checkpoint_name.replace(_CHECKPOINT_BLOCK, _BLOCK).replace(_CHECKPOINT_BIAS, _BIAS)
        mapped = expert_weight_map(name, MIXTRAL_EXPERT_NAMES)  # shard (expert, kind) of FusedMoE
        if mapped is not None:
            return mapped  # type: ignore[return-value]
        return super().weight_map(name)

    def checkpoint_name(self, param_name: str, shard_id: ShardId) -> str:
        name = expert_checkpoint_name(param_name, shard_id, MIXTRAL_EXPERT_NAMES) or super().checkpoint_name(
            param_name, shard_id)
        return name.replace(_BIAS, _CHECKPOINT_BIAS).replace(_BLOCK, _CHECKPOINT_BLOCK)
