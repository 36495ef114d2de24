"""DeepSeek V3 / R1 and Kimi K2 (``DeepseekV3ForCausalLM``): multi-head latent attention and a DeepSeek MoE.

Reference: ``transformers``' ``modeling_deepseek_v3.py``. For a flat batch of ``T`` tokens on one rank:

    h = embed(input_ids)                                   vocab-parallel
    for each layer i:
        h = h + mla(rms_norm(h))                           worker/layers/mla.py: the cache holds latents
        h = h + mlp_i(rms_norm(h))                         one all-reduce either way
                 mlp_i = down(silu(gate(x)) * up(x))       i < first_k_dense_replace (``intermediate_size``)
                 mlp_i = DeepSeek MoE                      the others: sigmoid routing, expert groups,
                                                           correction bias, shared experts
    h = rms_norm(h); logits = lm_head(h)

RoPE turns only the decoupled ``qk_rope_head_dim`` dimensions (``transformers`` sets the
config's ``head_dim`` to it), so the step's ``cos, sin`` are of that width. The MoE block is
worker/layers/moe_routing.py's ``deepseek_moe_block`` (``DeepseekV3MoE``): sigmoid scores,
top-k chosen with ``e_score_correction_bias`` within the ``topk_group`` best of ``n_group``
expert groups but weighted without it, renormalised (``norm_topk_prob``), times
``routed_scaling_factor``, plus ``n_shared_experts`` always-on shared experts; experts split by
tensor parallelism like the dense MLP, one all-reduce. Config keys read here:
``first_k_dense_replace`` (3), MLA's (worker/layers/mla.py) and the MoE block's
(``n_routed_experts``, ``num_experts_per_tok``, ``n_group``, ``topk_group``, ``norm_topk_prob``,
``routed_scaling_factor``, ``moe_intermediate_size``, ``n_shared_experts``).

Checkpoint names are ``transformers``' one to one except ``gate_proj``/``up_proj``, fused into
``gate_up_proj`` (dense and shared experts), and the routed experts' ``experts.{e}.*_proj``,
stacked (worker/layers/moe.py). Tensors of the multi-token-prediction layers that DeepSeek V3
checkpoints append (``model.layers.<num_hidden_layers>.*``) are not read: they serve
speculative decoding, not the model.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.layers.mla import MultiHeadLatentAttention
from worker.layers.moe import QWEN_EXPERT_NAMES, expert_checkpoint_name, expert_weight_map
from worker.layers.moe_routing import DEEPSEEK_V3_DEFAULTS, deepseek_moe_block, is_deepseek_moe_layer
from worker.models.base import ShardId
from worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from worker.parallel_state import ParallelContext


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """DeepSeek V3: :class:`MultiHeadLatentAttention` and per layer a dense MLP or a DeepSeek MoE block.

    ``--quantization int8|int4`` (or ``fp8`` on an FP8 checkpoint) quantizes the dense MLPs and the shared and
    routed experts (most of the weights); the attention stays float: the absorbed decode reads ``kv_b_proj``'s
    weight itself (worker/layers/mla.py), and the down-projections are small. An FP8 checkpoint's attention
    projections are dequantized at load.

    Raises:
        ValueError: a bad config value (named).
    """

    stacked_params_mapping = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        attention = MultiHeadLatentAttention(config, ctx, dtype)  # float: its absorbed form reads kv_b_proj's weight
        if not is_deepseek_moe_layer(config, layer_index, DEEPSEEK_V3_DEFAULTS):
            return LlamaDecoderLayer(config, ctx, dtype, attention, LlamaMLP(config, ctx, dtype, quantization))
        moe = deepseek_moe_block(config, ctx, dtype, quantization, DEEPSEEK_V3_DEFAULTS)
        return LlamaDecoderLayer(config, ctx, dtype, attention, moe)

    def weight_map(self, checkpoint_name: str) -> tuple[str, ShardId] | None:
        if checkpoint_name.startswith(self.layers_prefix):
            index = checkpoint_name[len(self.layers_prefix):].partition(".")[0]
            if index.isdigit() and int(index) >= self.config.num_hidden_layers:
                return None  # a multi-token-prediction layer
        mapped = expert_weight_map(checkpoint_name, QWEN_EXPERT_NAMES)  # shard (expert, kind) of the stacked experts
        if mapped is not None:
            return mapped  # type: ignore[return-value]
        return super().weight_map(checkpoint_name)

    def checkpoint_name(self, param_name: str, shard_id: ShardId) -> str:
        return expert_checkpoint_name(param_name, shard_id, QWEN_EXPERT_NAMES) or super().checkpoint_name(
            param_name, shard_id)
