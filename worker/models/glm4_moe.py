"""GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``): partial RoPE, optional QK-norm, DeepSeek-V3-style sigmoid-routed MoE.

Reference: ``transformers``' ``modeling_glm4_moe.py`` (GLM-4.5 Team 2025, arXiv:2508.06471).
For a flat batch of ``T`` tokens on one rank:

    h = embed(input_ids)
    for each layer i:
        q, k, v = qkv_proj(rms_norm(h))                   bias when ``attention_bias``; o_proj has none
        q, k = q_norm(q), k_norm(k)                       per head, only when ``use_qk_norm``
        q, k = rope(q[..., :r]) ++ q[..., r:], ...        partial RoPE: r = head_dim * partial_rotary_factor
        h = h + o_proj(attention(q, k, v))
        h = h + mlp_i(rms_norm(h))                        one all-reduce either way
                 mlp_i = down(silu(gate(x)) * up(x))       i < first_k_dense_replace (``intermediate_size``)
                 mlp_i = routed(x) + shared_experts(x)     the others (worker/layers/moe_routing.py)
    h = rms_norm(h); logits = lm_head(h)

The routed experts are chosen by ``sigmoid(router(x)) + e_score_correction_bias`` within the
``topk_group`` best of ``n_group`` expert groups, and weighted by the sigmoid scores without
the bias (renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``); the shared
experts are one SwiGLU MLP of ``n_shared_experts * moe_intermediate_size``.

The RoPE is ``transformers``' "rotate half" within the rotated ``r`` dims (dimension ``i``
pairs with ``i + r / 2``), not GLM-4's (dense) interleaved pairs. ``partial_rotary_factor``
defaults to 0.5 (Glm4MoeConfig). Config keys read here: ``attention_bias``, ``use_qk_norm``,
``n_routed_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``n_shared_experts``,
``n_group``, ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``,
``first_k_dense_replace`` (``partial_rotary_factor`` is :class:`ModelConfig`'s ``rotary_dim``).
Checkpoint names under ``mlp.``: ``gate.weight``, ``gate.e_score_correction_bias``,
``experts.{e}.gate_proj/up_proj/down_proj.weight``, ``shared_experts.gate_proj/up_proj/down_proj.weight``.
The multi-token-prediction layers that GLM-4.5 checkpoints append (``model.layers.{num_hidden_layers}.``)
are not read: the loader skips layers past the model's (worker/models/base.py's stage mapping).
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata
from worker.layers.moe import QWEN_EXPERT_NAMES, expert_checkpoint_name, expert_weight_map
from worker.layers.moe_routing import GLM4_MOE_DEFAULTS, deepseek_moe_block, is_deepseek_moe_layer
from worker.layers.norm import RMSNorm
from worker.layers.partial_rotary import rotate_partial_and_cache
from worker.layers.rotary import rotate_and_cache
from worker.models.base import KVCache, ShardId
from worker.models.llama import Biases, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, Rope
from worker.parallel_state import ParallelContext


class PartialRotaryAttention(LlamaAttention):
    """Llama attention rotating the first ``config.rotary_dim`` dims of each head, with optional per-head QK-norm.

    Args: those of :class:`LlamaAttention`, and ``qk_norm``: RMS-normalise every query and key
    head (over ``head_dim``) before the rotation, as Qwen3; the norms are named ``q_norm``/``k_norm``.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None, biases: Biases, *, qk_norm: bool,
                 sliding_window: int | None = None) -> None:
        super().__init__(config, ctx, dtype, quantization, biases, sliding_window=sliding_window)
        self.rotary_dim = config.rotary_dim
        self.qk_norm: tuple[RMSNorm, RMSNorm] | None = None
        if qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype, device=ctx.device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype, device=ctx.device)
            self.qk_norm = (self.q_norm, self.k_norm)

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (T, (num_heads + 2 * num_kv_heads) * d)
        if self.rotary_dim is None:  # partial_rotary_factor 1: whole heads, the fused path
            q, k, v = rotate_and_cache(qkv, *rope, *kv_cache, attn_metadata.slot_mapping, self.num_heads,
                                       self.num_kv_heads, qk_norm=self.qk_norm, kv_scales=self.attn.kv_scales)
        else:
            q, k, v = rotate_partial_and_cache(qkv, *rope, *kv_cache, attn_metadata.slot_mapping, self.num_heads,
                                               self.num_kv_heads, self.rotary_dim, qk_norm=self.qk_norm,
                                               kv_scales=self.attn.kv_scales)
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (T, num_heads * d)
        return self.o_proj(o)  # (T, hidden), all-reduced over ranks


class Glm4MoeForCausalLM(LlamaForCausalLM):
    """GLM-4.5 MoE: :class:`PartialRotaryAttention`, then a dense MLP (first layers) or the sigmoid-routed MoE block.

    Raises:
        ValueError: a bad routing key (named), ``hidden_act`` not silu. (The experts are float, int8 or int4.)
    """

    @classmethod
    def biases(cls, config: ModelConfig) -> Biases:
        """``attention_bias`` on q/k/v only (o_proj and the MLPs have none)."""
        return Biases(qkv=config.hf_value("attention_bias", False))

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        attention = PartialRotaryAttention(config, ctx, dtype, quantization, self.biases(config),
                                           qk_norm=config.hf_value("use_qk_norm", False),
                                           sliding_window=config.layer_sliding_window(layer_index))
        if not is_deepseek_moe_layer(config, layer_index, GLM4_MOE_DEFAULTS):
            return LlamaDecoderLayer(config, ctx, dtype, attention, LlamaMLP(config, ctx, dtype, quantization))
        moe = deepseek_moe_block(config, ctx, dtype, quantization, GLM4_MOE_DEFAULTS)
        return LlamaDecoderLayer(config, ctx, dtype, attention, moe)

    def weight_map(self, checkpoint_name: str) -> tuple[str, ShardId] | None:
        mapped = expert_weight_map(checkpoint_name, QWEN_EXPERT_NAMES)  # shard (expert, kind) of FusedMoE
        if mapped is not None:
            return mapped  # type: ignore[return-value]
        return super().weight_map(checkpoint_name)

    def checkpoint_name(self, param_name: str, shard_id: ShardId) -> str:
        return expert_checkpoint_name(param_name, shard_id, QWEN_EXPERT_NAMES) or super().checkpoint_name(
            param_name, shard_id)
