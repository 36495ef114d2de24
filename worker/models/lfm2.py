"""LFM2 (Liquid AI): a hybrid of gated short-convolution layers and QK-normed attention layers.

Reference: ``transformers``' ``modeling_lfm2.py``. Per layer, on this rank's shard:

    x = operator_norm(h)                                  RMSNorm (norm_eps)
    h = h + (self_attn(x) if layer_types[i] == "full_attention" else conv(x))
    h = h + feed_forward(ffn_norm(h))                     w2(silu(w1(x)) * w3(x)), SwiGLU
    ... after the last layer: embedding_norm (the final RMSNorm, despite its name)

* attention: Llama's GQA attention with RoPE, each query and key head RMS-normalised first
  (``q_layernorm``, ``k_layernorm``, replicated), projections without bias, output ``out_proj``;
* conv: the gated short convolution (worker/layers/short_conv.py), a *state layer*: its per-sequence
  state is the convolution's last ``conv_L_cache - 1`` inputs, kept in the state pool
  (worker/state_cache.py), not in KV blocks.

Config keys read here: ``norm_eps`` (1e-5), ``conv_L_cache`` (3), ``conv_bias`` (False), and the MLP
width rule of ``Lfm2MLP``: with ``block_auto_adjust_ff_dim`` (True) the width is
``int(2 * intermediate_size / 3)``, scaled by ``block_ffn_dim_multiplier`` (1.0) and rounded up to
a multiple of ``block_multiple_of`` (256). ``layer_types`` (or the older ``full_attn_idxs``)
says which layers attend (tpserve/hybrid_layers.py). Tied embeddings by default.
Checkpoint names: ``feed_forward.w1``/``w3`` are stacked into ``w13`` here, ``model.embedding_norm``
is this model's final ``model.norm``.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata, PagedAttention
from worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from worker.layers.norm import RMSNorm, SiluAndMul
from worker.layers.rotary import rotate_and_cache
from worker.layers.short_conv import ShortConv
from worker.models.base import LLAMA_STACKED_PARAMS, KVCache, ShardId
from worker.models.llama import LlamaForCausalLM, Rope
from worker.parallel_state import ParallelContext

#: The final norm's checkpoint prefix, and the name of the parameter it fills here.
_FINAL_NORM = ("model.embedding_norm.", "model.norm.")


def lfm2_mlp_width(config: ModelConfig) -> int:
    """The SwiGLU width ``Lfm2MLP`` builds from ``intermediate_size`` (module docstring)."""
    width = config.intermediate_size
    if config.hf_value("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = config.hf_value("block_ffn_dim_multiplier", 1.0, float)
        if multiplier is not None:
            multiple = config.hf_value("block_multiple_of", 256)
            width = multiple * -(-int(multiplier * width) // multiple)
    return width


class Lfm2Attention(nn.Module):
    """GQA self-attention with per-head QK RMSNorm, on this rank's heads; ``out_proj`` row-parallel."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None) -> None:
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.total_num_heads, config.total_num_kv_heads,
                                          ctx, bias=False, dtype=dtype, quantization=quantization)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.out_proj = RowParallelLinear(config.total_num_heads * d, config.hidden_size, ctx, bias=False,
                                          dtype=dtype, quantization=quantization)
        self.q_layernorm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, device=ctx.device)
        self.k_layernorm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, device=ctx.device)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, scale=d**-0.5)

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (T, (num_heads + 2 * num_kv_heads) * d)
        q, k, v = rotate_and_cache(qkv, *rope, *kv_cache, attn_metadata.slot_mapping, self.num_heads,
                                   self.num_kv_heads, qk_norm=(self.q_layernorm, self.k_layernorm),
                                   kv_scales=self.attn.kv_scales)  # normed, rotated, cached
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (T, num_heads * d)
        return self.out_proj(o)  # (T, hidden), all-reduced over ranks


class Lfm2MLP(nn.Module):
    """``w2(silu(w1(x)) * w3(x))``; ``w1``/``w3`` fused as ``w13`` (column-parallel), ``w2`` row-parallel."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None) -> None:
        super().__init__()
        width = config.intermediate_size  # already Lfm2MLP's width (Lfm2ForCausalLM's constructor)
        self.w13 = MergedColumnParallelLinear(config.hidden_size, [width, width], ctx, bias=False, dtype=dtype,
                                              quantization=quantization)
        self.act_fn = SiluAndMul()
        self.w2 = RowParallelLinear(width, config.hidden_size, ctx, bias=False, dtype=dtype, quantization=quantization)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w13(x)))  # (T, hidden), all-reduced over ranks


class Lfm2DecoderLayer(nn.Module):
    """One LFM2 layer: ``self_attn`` (an attention layer) or ``conv`` (a state layer), then the MLP."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None, layer_index: int) -> None:
        super().__init__()
        eps, device = config.rms_norm_eps, ctx.device
        self.operator_norm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.is_attention = config.layer_types[layer_index] != "conv"
        if self.is_attention:
            self.self_attn = Lfm2Attention(config, ctx, dtype, quantization)
        else:
            self.conv = ShortConv(config.hidden_size, config.hf_value("conv_L_cache", 3), ctx,
                                  bias=config.hf_value("conv_bias", False), dtype=dtype, quantization=quantization)
        self.ffn_norm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.feed_forward = Lfm2MLP(config, ctx, dtype, quantization)

    def forward(self, rope: Rope, h: torch.Tensor, cache: tuple[torch.Tensor, ...],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        x = self.operator_norm(h)  # (T, hidden)
        if self.is_attention:
            a = self.self_attn(rope, x, cache, attn_metadata)  # (T, hidden)
        else:  # the state layer: this layer's state tuple, the step's StateMetadata
            assert attn_metadata.state is not None, "a hybrid step without StateMetadata"
            a = self.conv(x, cache, attn_metadata.state)  # (T, hidden)
        h, x = self.ffn_norm.add_and_norm(h, a)  # h + a, and its norm
        return h + self.feed_forward(x)  # (T, hidden)


class Lfm2ForCausalLM(LlamaForCausalLM):
    """The LFM2 causal LM (``Lfm2ForCausalLM``); constructor as :class:`~worker.models.base.CausalLM`'s.

    One pipeline stage only (``supports_pipeline`` False: the state pool is not split by stage).

    Raises:
        ValueError: a config value of the wrong type (named), or the MLP width or ``hidden_size``
            not divisible by the tensor-parallel degree.
    """

    stacked_params_mapping = LLAMA_STACKED_PARAMS + (("w13", "w1", 0), ("w13", "w3", 1))
    supports_pipeline = False

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, *, tie_word_embeddings: bool,
                 quantization: Quantization | None = None) -> None:
        width = lfm2_mlp_width(config)
        if width % ctx.tp_size:
            raise ValueError(f"LFM2's MLP width {width} is not divisible by tensor_parallel_size={ctx.tp_size}")
        config = dataclasses.replace(config, rms_norm_eps=config.hf_value("norm_eps", 1e-5, float),
                                     intermediate_size=width)
        super().__init__(config, ctx, dtype, tie_word_embeddings=tie_word_embeddings, quantization=quantization)

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        return Lfm2DecoderLayer(config, ctx, dtype, quantization, layer_index)

    def state_layers(self) -> dict[int, nn.Module]:
        """The short-convolution layers: ``{layer index: ShortConv}``."""
        return {i: cast(nn.Module, layer.conv) for i, layer in enumerate(self.model.layers) if not layer.is_attention}

    def weight_map(self, checkpoint_name: str) -> tuple[str, ShardId] | None:
        """As the base's, with ``model.embedding_norm.`` read into ``model.norm.``."""
        if checkpoint_name.startswith(_FINAL_NORM[0]):
            checkpoint_name = _FINAL_NORM[1] + checkpoint_name[len(_FINAL_NORM[0]):]
        return super().weight_map(checkpoint_name)

    def checkpoint_name(self, param_name: str, shard_id: ShardId) -> str:
        """Inverse of :meth:`weight_map`."""
        name = super().checkpoint_name(param_name, shard_id)
        return _FINAL_NORM[0] + name[len(_FINAL_NORM[1]):] if name.startswith(_FINAL_NORM[1]) else name
