"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's decoder (QK-norm) with sparse MoE blocks as its MLPs.

Reference: ``transformers``' ``modeling_qwen3_moe.py``. For a flat batch of ``T`` tokens on one rank:

    h = embed(input_ids)
    for each layer i:
        h = h + o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v))   as Qwen3 (worker/models/qwen3.py)
        h = h + mlp_i(rms_norm(h))                                       one all-reduce either way
                 mlp_i = sum over x's top-k experts e of p_e * expert_e(x)  sparse layers (worker/layers/moe.py)
                 mlp_i = down(silu(gate(x)) * up(x))                       the others (``intermediate_size``)
    h = rms_norm(h); logits = lm_head(h)

``p`` is the softmax over all experts restricted to the top k, renormalised when
``norm_topk_prob``. Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or ``(i + 1)``
is not a multiple of ``decoder_sparse_step``. Config keys read here: ``num_experts`` (or
``num_local_experts``, as ``transformers`` 5 saves it), ``num_experts_per_tok``,
``moe_intermediate_size``, ``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``,
``attention_bias``. Checkpoint names under ``mlp.``: ``gate.weight``,
``experts.{e}.gate_proj/up_proj/down_proj.weight``.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.layers.moe import QWEN_EXPERT_NAMES, SparseMoeBlock, expert_checkpoint_name, expert_weight_map, \
    is_sparse_layer
from worker.models.base import ShardId
from worker.models.llama import LlamaDecoderLayer, LlamaMLP
from worker.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM
from worker.parallel_state import ParallelContext


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3 attention, and per layer a :class:`SparseMoeBlock` or a dense MLP.

    Raises:
        ValueError: a bad MoE config value (named). (The experts are float, int8 or int4.)
    """

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        # Hub checkpoints say num_experts; transformers 5 writes num_local_experts (its attribute map).
        num_experts = config.hf_value("num_experts", config.hf_value("num_local_experts", 128))
        attention = Qwen3Attention(config, ctx, dtype, quantization, self.biases(config),
                                   sliding_window=config.layer_sliding_window(layer_index))
        if not is_sparse_layer(layer_index, num_experts, config.hf_value("decoder_sparse_step", 1),
                               config.hf_value("mlp_only_layers", [])):
            return LlamaDecoderLayer(config, ctx, dtype, attention, LlamaMLP(config, ctx, dtype, quantization))
        moe = SparseMoeBlock(
            config.hidden_size, num_experts, config.hf_value("num_experts_per_tok", 8),
            config.hf_value("moe_intermediate_size", 768), ctx, dtype,
            renormalize=config.hf_value("norm_topk_prob", False), weights_in_dtype=True, quantization=quantization,
        )
        return LlamaDecoderLayer(config, ctx, dtype, attention, moe)

    def weight_map(self, checkpoint_name: str) -> tuple[str, ShardId] | None:
        mapped = expert_weight_map(checkpoint_name, QWEN_EXPERT_NAMES)
        return mapped if mapped is not None else super().weight_map(checkpoint_name)

    def checkpoint_name(self, param_name: str, shard_id: ShardId) -> str:
        return expert_checkpoint_name(param_name, shard_id, QWEN_EXPERT_NAMES) or super().checkpoint_name(
            param_name, shard_id)
