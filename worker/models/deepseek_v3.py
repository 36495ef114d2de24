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
config's ``head_dim`` to it), so the step's ``cos, sin`` are of that width. Config keys read
here: ``first_k_dense_replace`` (3), and MLA's (worker/layers/mla.py). Checkpoint names are
``transformers``' one to one except ``gate_proj``/``up_proj``, fused into ``gate_up_proj``.
Tensors of the multi-token-prediction layers that DeepSeek V3 checkpoints append
(``model.layers.<num_hidden_layers>.*``) are not read: they serve speculative decoding, not the model.

The routed-experts layers are not served yet: a checkpoint with any (``first_k_dense_replace
< num_hidden_layers``) is refused at load with one line.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.layers.mla import MultiHeadLatentAttention
from worker.models.base import ShardId
from worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from worker.parallel_state import ParallelContext


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """DeepSeek V3: :class:`MultiHeadLatentAttention` and per layer a dense MLP (or a DeepSeek MoE).

    Raises:
        ValueError: ``--quantization`` (MLA's projections are float only), a routed-experts layer,
            or a bad config value (named).
    """

    stacked_params_mapping = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, *, tie_word_embeddings: bool,
                 quantization: Quantization | None = None) -> None:
        if quantization is not None:
            raise ValueError(f"--quantization {quantization} is not supported for {config.architecture} "
                             "(multi-head latent attention's projections are float only)")
        first_dense = config.hf_value("first_k_dense_replace", 3)
        if first_dense < config.num_hidden_layers:
            raise ValueError(f"{config.architecture}: layers {first_dense}..{config.num_hidden_layers - 1} are "
                             f"routed-experts layers (first_k_dense_replace={first_dense}), not served yet")
        super().__init__(config, ctx, dtype, tie_word_embeddings=tie_word_embeddings)

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        attention = MultiHeadLatentAttention(config, ctx, dtype)
        return LlamaDecoderLayer(config, ctx, dtype, attention, LlamaMLP(config, ctx, dtype))

    def weight_map(self, checkpoint_name: str) -> tuple[str, ShardId] | None:
        if checkpoint_name.startswith(self.layers_prefix):
            index = checkpoint_name[len(self.layers_prefix):].partition(".")[0]
            if index.isdigit() and int(index) >= self.config.num_hidden_layers:
                return None  # a multi-token-prediction layer
        return super().weight_map(checkpoint_name)
