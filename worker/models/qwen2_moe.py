"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's decoder with sparse MoE blocks that add a gated shared expert.

Reference: ``transformers``' ``modeling_qwen2_moe.py``. For a flat batch of ``T`` tokens on one rank:

    h = embed(input_ids)
    for each layer i:
        h = h + o_proj(attention(rope(q, k), v))           q/k/v bias when ``qkv_bias`` (default true)
        h = h + mlp_i(rms_norm(h))                         one all-reduce either way
                 mlp_i = moe(x) + sigmoid(x . w_g) * shared_expert(x)   sparse layers (worker/layers/moe.py)
                 mlp_i = down(silu(gate(x)) * up(x))                     the others (``intermediate_size``)
    h = rms_norm(h); logits = lm_head(h)

Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or ``(i + 1)`` is not a
multiple of ``decoder_sparse_step``. Config keys read here: ``num_experts``,
``num_experts_per_tok``, ``moe_intermediate_size``, ``shared_expert_intermediate_size``,
``norm_topk_prob`` (default false: the top-k probabilities are not renormalised),
``decoder_sparse_step``, ``mlp_only_layers``, ``qkv_bias``. Checkpoint names under
``mlp.``: ``gate.weight``, ``experts.{e}.gate_proj/up_proj/down_proj.weight``,
``shared_expert.gate_proj/up_proj/down_proj.weight``, ``shared_expert_gate.weight``.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.layers.moe import QWEN_EXPERT_NAMES, SparseMoeBlock, expert_checkpoint_name, expert_weight_map, \
    is_sparse_layer
from worker.models.base import ShardId
from worker.models.llama import Biases, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from worker.parallel_state import ParallelContext


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE: Qwen2 attention, and per layer a shared-expert :class:`SparseMoeBlock` or a dense MLP.

    Raises:
        ValueError: a bad MoE config value (named). (The experts are float, int8 or int4.)
    """

    @classmethod
    def biases(cls, config: ModelConfig) -> Biases:
        return Biases(qkv=config.hf_value("qkv_bias", True))

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        # Hub checkpoints say num_experts; transformers 5 may write num_local_experts (its attribute map).
        num_experts = config.hf_value("num_experts", config.hf_value("num_local_experts", 60))
        attention = LlamaAttention(config, ctx, dtype, quantization, self.biases(config),
                                   sliding_window=config.layer_sliding_window(layer_index))
        if not is_sparse_layer(layer_index, num_experts, config.hf_value("decoder_sparse_step", 1),
                               config.hf_value("mlp_only_layers", [])):
            return LlamaDecoderLayer(config, ctx, dtype, attention, LlamaMLP(config, ctx, dtype, quantization))
        moe = SparseMoeBlock(
            config.hidden_size, num_experts, config.hf_value("num_experts_per_tok", 4),
            config.hf_value("moe_intermediate_size", 1408), ctx, dtype,
            renormalize=config.hf_value("norm_topk_prob", False), weights_in_dtype=True,
            shared_expert_intermediate_size=config.hf_value("shared_expert_intermediate_size", 5632),
            quantization=quantization,
        )
        return LlamaDecoderLayer(config, ctx, dtype, attention, moe)

    def weight_map(self, checkpoint_name: str) -> tuple[str, ShardId] | None:
        mapped = expert_weight_map(checkpoint_name, QWEN_EXPERT_NAMES)
        return mapped if mapped is not None else super().weight_map(checkpoint_name)

    def checkpoint_name(self, param_name: str, shard_id: ShardId) -> str:
        return expert_checkpoint_name(param_name, shard_id, QWEN_EXPERT_NAMES) or super().checkpoint_name(
            param_name, shard_id)
