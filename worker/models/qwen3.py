"""Qwen3 (dense): the Llama decoder with a per-head RMSNorm on the queries and keys before RoPE.

Reference: ``transformers``' ``modeling_qwen3.py``. Per layer, on this rank's heads:

    q, k, v = qkv_proj(rms_norm(h))                      column-parallel by head, no bias by default
    q, k = rope(q_norm(q)), rope(k_norm(k))              q_norm, k_norm: RMSNorm over head_dim, per head
    h = h + o_proj(attention(q, k, v))                   row-parallel, all-reduce
    h = h + down_proj(silu(gate) * up)                   as Llama

``head_dim`` comes from the config and need not be ``hidden_size / num_attention_heads``.
Config keys read here: ``attention_bias`` (q/k/v and o_proj, default False); the MLP has no
bias. The norms' weights ``(head_dim,)`` are replicated on every rank; the checkpoint names
them ``self_attn.q_norm.weight`` and ``self_attn.k_norm.weight``.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata
from worker.layers.norm import RMSNorm
from worker.layers.rotary import rotate_and_cache
from worker.models.base import KVCache
from worker.models.llama import (DECODE_BLOCK_ATTENTIONS, Biases, LlamaAttention, LlamaDecoderLayer,
                                 LlamaForCausalLM, LlamaMLP, Rope)
from worker.parallel_state import ParallelContext


class Qwen3Attention(LlamaAttention):
    """Llama attention with QK-norm: each query and key head RMS-normalised before the rotation."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None, biases: Biases, *, sliding_window: int | None = None) -> None:
        super().__init__(config, ctx, dtype, quantization, biases, sliding_window=sliding_window)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype, device=ctx.device)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype, device=ctx.device)

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (T, (num_heads + 2 * num_kv_heads) * d)
        q, k, v = rotate_and_cache(qkv, *rope, *kv_cache, attn_metadata.slot_mapping, self.num_heads,
                                   self.num_kv_heads, qk_norm=(self.q_norm, self.k_norm),
                                   kv_scales=self.attn.kv_scales)  # normed, rotated, cached
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (T, num_heads * d)
        return self.o_proj(o)  # (T, hidden), all-reduced over ranks


DECODE_BLOCK_ATTENTIONS.add(Qwen3Attention)  # the compiled decode layer normalises q and k per head too


class Qwen3ForCausalLM(LlamaForCausalLM):
    """The Qwen3 dense causal LM (``Qwen3ForCausalLM``); constructor and errors as :class:`LlamaForCausalLM`."""

    @classmethod
    def biases(cls, config: ModelConfig) -> Biases:
        """``attention_bias`` on q/k/v and o_proj (default False); never on the MLP."""
        attention_bias = config.hf_value("attention_bias", False)
        return Biases(qkv=attention_bias, o_proj=attention_bias)

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        biases = self.biases(config)
        attention = Qwen3Attention(config, ctx, dtype, quantization, biases,
                                   sliding_window=config.layer_sliding_window(layer_index))
        return LlamaDecoderLayer(config, ctx, dtype, attention, LlamaMLP(config, ctx, dtype, quantization, bias=biases.mlp))
