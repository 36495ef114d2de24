"""Mixtral (Jiang et al. 2024, arXiv:2401.04088): Mistral's decoder with a sparse mixture of experts as its MLP.

Reference: ``transformers``' ``modeling_mixtral.py``. For a flat batch of ``T`` tokens on one rank:

    h = embed(input_ids)
    for each layer:
        h = h + o_proj(attention(rope(q, k), v))          as Mistral: no bias, ``sliding_window`` if set
        h = h + moe(rms_norm(h))                          worker/layers/moe.py, one all-reduce
                 moe(x) = sum over x's top-2 of 8 experts e of p_e * down_e(silu(gate_e(x)) * up_e(x)),
                 p = softmax(router(x)) restricted to the top 2, renormalised
    h = rms_norm(h); logits = lm_head(h)

Config keys read here: ``num_local_experts``, ``num_experts_per_tok`` (the expert
width is ``intermediate_size``). The routing weights stay float32, as ``transformers``
keeps them. Checkpoint names: ``block_sparse_moe.gate.weight`` (router),
``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (gate/up/down of expert ``e``); the
block is the decoder layer's ``mlp`` here (as ``transformers`` 5 renames it).
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.layers.moe import MIXTRAL_EXPERT_NAMES, SparseMoeBlock, expert_checkpoint_name, expert_weight_map
from worker.models.base import ShardId
from worker.models.llama import Biases, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from worker.parallel_state import ParallelContext

_CHECKPOINT_BLOCK, _BLOCK = ".block_sparse_moe.", ".mlp."


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: :class:`LlamaForCausalLM`'s attention (no bias) and a :class:`SparseMoeBlock` in every layer.

    Raises:
        ValueError: a bad expert count. (The experts are float, int8 or int4: worker/layers/moe.py.)
    """

    @classmethod
    def biases(cls, config: ModelConfig) -> Biases:
        return Biases()

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        moe = SparseMoeBlock(config.hidden_size, config.hf_value("num_local_experts", 8),
                             config.hf_value("num_experts_per_tok", 2), config.intermediate_size, ctx, dtype,
                             renormalize=True, weights_in_dtype=False, quantization=quantization)
        attention = LlamaAttention(config, ctx, dtype, quantization, Biases(),
                                   sliding_window=config.layer_sliding_window(layer_index))
        return LlamaDecoderLayer(config, ctx, dtype, attention, moe)

    def weight_map(self, checkpoint_name: str) -> tuple[str, ShardId] | None:
        name = checkpoint_name.replace(_CHECKPOINT_BLOCK, _BLOCK)
        mapped = expert_weight_map(name, MIXTRAL_EXPERT_NAMES)
        return mapped if mapped is not None else super().weight_map(name)

    def checkpoint_name(self, param_name: str, shard_id: ShardId) -> str:
        name = expert_checkpoint_name(param_name, shard_id, MIXTRAL_EXPERT_NAMES) or super().checkpoint_name(
            param_name, shard_id)
        return name.replace(_BLOCK, _CHECKPOINT_BLOCK)
