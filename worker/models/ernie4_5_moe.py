"""Ernie 4.5 MoE (``Ernie4_5_MoeForCausalLM``: ERNIE-4.5-21B-A3B, -300B-A47B): interleaved RoPE, bias-corrected
softmax routing, shared experts, MoE from ``moe_layer_start_index`` every ``moe_layer_interval`` layers.

Reference: ``transformers``' ``modeling_ernie4_5_moe.py``. For a flat batch of ``T`` tokens on one rank:

    h = embed(input_ids)
    for each layer i:
        q, k = rope_pairs(q), rope_pairs(k)               interleaved RoPE over whole heads, in float32
        h = h + o_proj(attention(q, k, v))
        h = h + mlp_i(rms_norm(h))                        one all-reduce either way
                 mlp_i = routed(x) + shared_experts(x)     if (i + 1) % moe_layer_interval == 0 and
                                                           moe_layer_start_index <= i <= moe_layer_end_index
                 mlp_i = down(silu(gate(x)) * up(x))       else (``intermediate_size``)
    h = rms_norm(h); logits = lm_head(h)                  LM head tied to the embedding by default

Routing (worker/layers/moe_routing.py): ``p = softmax(router(x))`` in float32; the top
``moe_k`` experts by ``p + e_score_correction_bias``; weighted by ``p`` without the bias,
divided by ``max(sum, moe_norm_min)`` and rounded to the model dtype. The shared experts are
one SwiGLU MLP of ``moe_num_shared_experts * moe_intermediate_size``. ``moe_layer_end_index``
-1 means the last layer. Checkpoint names under ``mlp.``: ``gate.weight``,
``moe_statics.e_score_correction_bias`` ``(1, E)`` (held as the router's ``(E,)``),
``experts.{e}.gate_proj/up_proj/down_proj.weight``, ``shared_experts.gate_proj/up_proj/down_proj.weight``.
``use_bias`` (biases on every projection and the LM head) is refused: the released
checkpoints have none. The multi-token-prediction weights (``mtp*``) are not read.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata
from worker.layers.moe import QWEN_EXPERT_NAMES, SparseMoeBlock, expert_checkpoint_name, expert_weight_map
from worker.layers.moe_routing import BiasedRouting, BiasedTopKRouter
from worker.layers.partial_rotary import rotate_partial_and_cache
from worker.models.base import KVCache, ShardId
from worker.models.llama import Biases, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, Rope
from worker.parallel_state import ParallelContext

_CHECKPOINT_BIAS, _BIAS = ".mlp.moe_statics.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"


class InterleavedRopeAttention(LlamaAttention):
    """Llama attention whose RoPE rotates the pairs ``(2i, 2i + 1)`` of each head (worker/layers/partial_rotary.py)."""

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (T, (num_heads + 2 * num_kv_heads) * d)
        q, k, v = rotate_partial_and_cache(qkv, *rope, *kv_cache, attn_metadata.slot_mapping, self.num_heads,
                                           self.num_kv_heads, kv_cache[0].shape[-1], interleaved=True,
                                           kv_scales=self.attn.kv_scales)
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (T, num_heads * d)
        return self.o_proj(o)  # (T, hidden), all-reduced over ranks


def is_ernie_moe_layer(layer_index: int, num_layers: int, start: int, end: int, interval: int) -> bool:
    """Whether Ernie layer ``layer_index`` is sparse, as ``Ernie4_5_MoeDecoderLayer`` decides (``end`` -1: the last)."""
    end = num_layers - 1 if end == -1 else end
    return (layer_index + 1) % interval == 0 and start <= layer_index <= end


class Ernie4_5_MoeForCausalLM(LlamaForCausalLM):  # noqa: N801 (the architecture's name)
    """Ernie 4.5 MoE: :class:`InterleavedRopeAttention`, then the bias-corrected MoE block or a dense MLP.

    Raises:
        ValueError: ``use_bias`` true, a bad MoE key (named), ``hidden_act`` not silu, or ``--quantization``.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, *, tie_word_embeddings: bool,
                 quantization: Quantization | None = None) -> None:
        if config.hf_value("use_bias", False):
            raise ValueError("use_bias=true (biases on every Ernie 4.5 projection and the LM head) is not supported; "
                             "the released checkpoints have none")
        super().__init__(config, ctx, dtype, tie_word_embeddings=tie_word_embeddings, quantization=quantization)

    @classmethod
    def biases(cls, config: ModelConfig) -> Biases:
        return Biases()

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        attention = InterleavedRopeAttention(config, ctx, dtype, quantization, Biases(),
                                             sliding_window=config.layer_sliding_window(layer_index))
        sparse = is_ernie_moe_layer(layer_index, config.num_hidden_layers, config.hf_value("moe_layer_start_index", 1),
                                    config.hf_value("moe_layer_end_index", -1), config.hf_value("moe_layer_interval", 1))
        if not sparse:
            return LlamaDecoderLayer(config, ctx, dtype, attention, LlamaMLP(config, ctx, dtype, quantization))
        num_experts = config.hf_value("moe_num_experts", 64)
        width = config.hf_value("moe_intermediate_size", 1536)
        routing = BiasedRouting(top_k=config.hf_value("moe_k", 6), score="softmax", norm_eps=0.0,
                                norm_min=config.hf_value("moe_norm_min", 1e-12, float), weights_in_dtype=True)
        moe = SparseMoeBlock(config.hidden_size, num_experts, routing.top_k, width, ctx, dtype, renormalize=True,
                             weights_in_dtype=True, quantization=quantization,
                             router=BiasedTopKRouter(config.hidden_size, num_experts, routing, ctx, dtype),
                             shared_experts_intermediate_size=config.hf_value("moe_num_shared_experts", 2) * width)
        return LlamaDecoderLayer(config, ctx, dtype, attention, moe)

    def weight_map(self, checkpoint_name: str) -> tuple[str, ShardId] | None:
        if checkpoint_name.startswith("mtp") or ".mtp" in checkpoint_name:
            return None  # the multi-token-prediction head, not served (transformers ignores it too)
        name = checkpoint_name.replace(_CHECKPOINT_BIAS, _BIAS)
        mapped = expert_weight_map(name, QWEN_EXPERT_NAMES)  # shard (expert, kind) of FusedMoE
        if mapped is not None:
            return mapped  # type: ignore[return-value]
        return super().weight_map(name)

    def checkpoint_name(self, param_name: str, shard_id: ShardId) -> str:
        name = expert_checkpoint_name(param_name, shard_id, QWEN_EXPERT_NAMES) or super().checkpoint_name(
            param_name, shard_id)
        return name.replace(_BIAS, _CHECKPOINT_BIAS)
