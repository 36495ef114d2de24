"""GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``): DeepSeek V3's multi-head latent attention with GLM's layer pattern.

Reference: ``transformers``' ``modeling_glm4_moe_lite.py``, whose attention *is*
``DeepseekV3Attention`` and whose MoE block is GLM-4.5's (the DeepSeek V3 block: sigmoid
routing with a correction bias, expert groups, shared experts). So the model is
:class:`worker.models.deepseek_v3.DeepseekV3ForCausalLM` (worker/layers/mla.py's latent cache
and all) with two differences:

* which layers are MoE: ``mlp_layer_types`` (``"dense"`` / ``"sparse"`` per layer; default the
  first dense, the rest sparse) instead of ``first_k_dense_replace``;
* the config class's defaults: 64 routed experts of width 1536, top 4, one group,
  ``routed_scaling_factor`` 1.8, one shared expert.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.layers.mla import MultiHeadLatentAttention
from worker.layers.moe_routing import BiasedRouting, DeepseekMoeDefaults, deepseek_moe_block
from worker.models.deepseek_v3 import DeepseekV3ForCausalLM
from worker.models.llama import LlamaDecoderLayer, LlamaMLP
from worker.parallel_state import ParallelContext

#: ``Glm4MoeLiteConfig``'s defaults (``first_k_dense_replace`` is not read: ``mlp_layer_types`` says).
GLM4_MOE_LITE_DEFAULTS = DeepseekMoeDefaults(BiasedRouting(top_k=4, routed_scaling_factor=1.8), num_experts=64,
                                             moe_intermediate_size=1536, n_shared_experts=1, first_k_dense_replace=1)


def mlp_layer_types(config: ModelConfig) -> list[str]:
    """Per layer ``"dense"`` or ``"sparse"``: ``mlp_layer_types``, else the first dense and the rest sparse.

    Raises:
        ValueError: not one entry per layer, or an entry that is neither (one line naming the key).
    """
    layers = config.num_hidden_layers
    types = config.hf_value("mlp_layer_types", ["dense"] + ["sparse"] * (layers - 1), list)
    if len(types) != layers or not set(types) <= {"dense", "sparse"}:
        raise ValueError(f"config.json mlp_layer_types={types!r} must list 'dense' or 'sparse' for each of the "
                         f"{layers} layers")
    return types


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash: :class:`MultiHeadLatentAttention` and per layer a dense MLP or the DeepSeek MoE block.

    Raises:
        ValueError: a bad ``mlp_layer_types`` or routing value (named). ``--quantization``: as DeepSeek V3's.
    """

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        attention = MultiHeadLatentAttention(config, ctx, dtype)
        if mlp_layer_types(config)[layer_index] == "dense":
            return LlamaDecoderLayer(config, ctx, dtype, attention, LlamaMLP(config, ctx, dtype, quantization))
        moe = deepseek_moe_block(config, ctx, dtype, quantization, GLM4_MOE_LITE_DEFAULTS)
        return LlamaDecoderLayer(config, ctx, dtype, attention, moe)
