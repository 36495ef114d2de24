"""StarCoder2: the Llama attention with biases, LayerNorm with a bias, and a plain GELU MLP.

Reference: ``transformers``' ``modeling_starcoder2.py`` (Lozhkov et al. 2024, arXiv:2402.19173).
For a flat batch of ``T`` tokens on one rank:

    h = embed(input_ids)                                      vocab-parallel, all-reduce
    for each layer (every one over the ``sliding_window``, when set):
        h = h + o_proj(attention(rope(q, k), v))              q, k, v, o with a bias (``use_bias``)
                 where q, k, v = qkv_proj(layer_norm(h))      column-parallel by head
        h = h + c_proj(gelu(c_fc(layer_norm(h))))            c_fc column-, c_proj row-parallel, bias ``use_bias``
    h = layer_norm(h)
    logits = lm_head(h)                                       tied by default

Every norm is ``torch.nn.LayerNorm`` with weight and bias, epsilon ``norm_epsilon`` (default
1e-5); the GELU is ``hidden_act``'s (``gelu_pytorch_tanh`` by default: the tanh approximation).
Pipeline stages and the weight layout are Llama's (worker/models/llama.py) except the MLP,
whose ``c_fc`` and ``c_proj`` keep their checkpoint names.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata
from worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker.layers.norm import LayerNorm
from worker.models.base import KVCache
from worker.models.gemma2 import GELU_APPROXIMATIONS
from worker.models.llama import Biases, LlamaAttention, LlamaForCausalLM, Rope
from worker.parallel_state import ParallelContext


def norm_epsilon(config: ModelConfig) -> float:
    """StarCoder2's LayerNorm epsilon: ``norm_epsilon`` (default 1e-5, ``Starcoder2Config``)."""
    return config.hf_value("norm_epsilon", 1e-5, float)


class Starcoder2MLP(nn.Module):
    """``c_proj(gelu(c_fc(x)))``: no gate; ``c_fc`` column-parallel, ``c_proj`` row-parallel (all-reduce)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None, *, bias: bool) -> None:
        super().__init__()
        self.approximate = GELU_APPROXIMATIONS[config.hidden_act]
        self.c_fc = ColumnParallelLinear(config.hidden_size, config.intermediate_size, ctx, bias=bias, dtype=dtype,
                                         quantization=quantization)
        self.c_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, ctx, bias=bias, dtype=dtype,
                                        quantization=quantization)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.c_fc(x), approximate=self.approximate)  # (T, intermediate / tp)
        return self.c_proj(h)  # (T, hidden), all-reduced over ranks


class Starcoder2DecoderLayer(nn.Module):
    """Pre-norm residual block with LayerNorms (weight and bias): ``self_attn`` then ``mlp``."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, self_attn: nn.Module,
                 mlp: nn.Module) -> None:
        super().__init__()
        eps = norm_epsilon(config)
        self.input_layernorm = LayerNorm(config.hidden_size, eps, bias=True, dtype=dtype, device=ctx.device)
        self.self_attn = self_attn
        self.post_attention_layernorm = LayerNorm(config.hidden_size, eps, bias=True, dtype=dtype, device=ctx.device)
        self.mlp = mlp

    def forward(self, rope: Rope, h: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        h = h + self.self_attn(rope, self.input_layernorm(h), kv_cache, attn_metadata)  # (T, hidden)
        return h + self.mlp(self.post_attention_layernorm(h))  # (T, hidden)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """StarCoder2 (``Starcoder2ForCausalLM``); constructor and pipeline stages as :class:`LlamaForCausalLM`.

    Raises:
        ValueError: ``hidden_act`` is not a GELU (``gelu_pytorch_tanh`` or ``gelu``), or
            ``use_bias`` / ``norm_epsilon`` of the wrong type.
    """

    hidden_acts = tuple(GELU_APPROXIMATIONS)

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, *, tie_word_embeddings: bool,
                 quantization: Quantization | None = None) -> None:
        if "hidden_act" not in config.hf_config:  # ModelConfig's default is Llama's; Starcoder2Config's is this
            config = dataclasses.replace(config, hidden_act="gelu_pytorch_tanh")
        super().__init__(config, ctx, dtype, tie_word_embeddings=tie_word_embeddings, quantization=quantization)

    @classmethod
    def biases(cls, config: ModelConfig) -> Biases:
        """``use_bias`` (default True) on q/k/v, o_proj and the MLP."""
        use_bias = config.hf_value("use_bias", True)
        return Biases(qkv=use_bias, o_proj=use_bias, mlp=use_bias)

    def final_norm(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype) -> nn.Module:
        return LayerNorm(config.hidden_size, norm_epsilon(config), bias=True, dtype=dtype, device=ctx.device)

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        biases = self.biases(config)
        attention = LlamaAttention(config, ctx, dtype, quantization, biases,
                                   sliding_window=config.layer_sliding_window(layer_index))
        mlp = Starcoder2MLP(config, ctx, dtype, quantization, bias=biases.mlp)
        return Starcoder2DecoderLayer(config, ctx, dtype, attention, mlp)
