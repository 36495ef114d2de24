"""Cohere Command R: one LayerNorm per layer feeding attention and MLP in parallel, interleaved RoPE.

Reference: ``transformers``' ``modeling_cohere.py`` (``CohereConfig``). For a flat batch of
``T`` tokens on one rank:

    h = embed(input_ids)                                      vocab-parallel, all-reduce
    for each layer:
        x = layer_norm(h)                                     one norm, no bias
        h = h + o_proj(attention(rope(q, k), v))              rope: interleaved pairs (2i, 2i+1)
                + down_proj(silu(gate) * up)                  both read x; each row-parallel, all-reduce
                 where q, k, v = qkv_proj(x)                  column-parallel by head
                       q, k = q_norm(q), k_norm(k)            when use_qk_norm: a LayerNorm per head
    h = layer_norm(h)
    logits = lm_head(h) * logit_scale                         tied by default; logit_scale default 0.0625

Every norm is ``CohereLayerNorm``: mean and variance over the last dimension, a weight and
no bias, epsilon ``layer_norm_eps`` (default 1e-5). With ``use_qk_norm`` the q and k norms
carry one weight vector per head, ``(num_heads, head_dim)`` and ``(num_key_value_heads,
head_dim)``: each rank holds its heads' rows. ``attention_bias`` puts a bias on q/k/v and
o_proj; the MLP has none. The rotation is GPT-J's (worker/layers/rotary.py,
:func:`~worker.layers.rotary.apply_rotary_interleaved`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata, PagedAttention, write_kv_cache
from worker.layers.linear import QKVParallelLinear, RowParallelLinear
from worker.layers.norm import LayerNorm
from worker.layers.rotary import apply_rotary_interleaved
from worker.layers.weights import CheckpointSource, check_shape, copy_into, new_parameter, read_narrow
from worker.models.base import KVCache
from worker.models.llama import Biases, LlamaForCausalLM, LlamaMLP, Rope
from worker.parallel_state import ParallelContext


def layer_norm_eps(config: ModelConfig) -> float:
    """Cohere's LayerNorm epsilon: ``layer_norm_eps`` (default 1e-5, ``CohereConfig``)."""
    return config.hf_value("layer_norm_eps", 1e-5, float)


class HeadLayerNorm(nn.Module):
    """A LayerNorm over ``head_dim`` with one weight vector per head, for this rank's heads.

    Args:
        total_heads: heads of the checkpoint's weight ``(total_heads, head_dim)``.
        first_head, num_heads: this rank's heads, rows ``[first_head, first_head + num_heads)``.

    Shapes: ``x (T, num_heads, head_dim) -> (T, num_heads, head_dim)``, ``x.dtype``; statistics
    and weight in float32 (``CohereLayerNorm`` with a tuple ``hidden_size``).
    """

    def __init__(self, total_heads: int, first_head: int, num_heads: int, head_dim: int, eps: float, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.total_heads, self.first_head, self.eps = total_heads, first_head, eps
        self.weight = new_parameter((num_heads, head_dim), dtype, device, self.weight_loader)
        self.weight.shard_ids = (None,)  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """Copy this rank's rows of the ``(total_heads, head_dim)`` weight."""
        check_shape(source, (self.total_heads, param.shape[1]))
        copy_into(param.data, read_narrow(source, 0, self.first_head, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), x.shape[-1:], None, None, self.eps)  # (T, num_heads, head_dim)
        return (y * self.weight.float()).to(x.dtype)


class CohereAttention(nn.Module):
    """Self-attention of one layer on this rank's heads: optional per-head QK LayerNorm, interleaved RoPE."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None, biases: Biases, *, sliding_window: int | None = None) -> None:
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.total_num_heads, config.total_num_kv_heads,
                                          ctx, bias=biases.qkv, dtype=dtype, quantization=quantization)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.total_num_heads * d, config.hidden_size, ctx, bias=biases.o_proj,
                                        dtype=dtype, quantization=quantization)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, scale=d**-0.5, sliding_window=sliding_window)
        self.q_norm = self.k_norm = None
        if config.hf_value("use_qk_norm", False):
            eps = layer_norm_eps(config)
            self.q_norm = HeadLayerNorm(config.total_num_heads, ctx.tp_rank * self.num_heads, self.num_heads, d, eps,
                                        dtype=dtype, device=ctx.device)
            self.k_norm = HeadLayerNorm(config.total_num_kv_heads, self.qkv_proj.kv_head_start, self.num_kv_heads, d,
                                        eps, dtype=dtype, device=ctx.device)

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (T, (num_heads + 2 * num_kv_heads) * d)
        q, k, v = qkv.view(qkv.shape[0], -1, self.attn.head_size).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)  # (T, heads, d) each
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_interleaved(q, *rope), apply_rotary_interleaved(k, *rope)
        write_kv_cache(k, v, *kv_cache, attn_metadata.slot_mapping, self.attn.kv_scales)
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (T, num_heads * d)
        return self.o_proj(o)  # (T, hidden), all-reduced over ranks


class CohereDecoderLayer(nn.Module):
    """``h + attention(x) + mlp(x)`` with ``x = input_layernorm(h)``: the parallel block."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, self_attn: nn.Module,
                 mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(config.hidden_size, layer_norm_eps(config), bias=False, dtype=dtype,
                                         device=ctx.device)
        self.self_attn = self_attn
        self.mlp = mlp

    def forward(self, rope: Rope, h: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        x = self.input_layernorm(h)  # (T, hidden)
        return h + self.self_attn(rope, x, kv_cache, attn_metadata) + self.mlp(x)  # (T, hidden)


class CohereForCausalLM(LlamaForCausalLM):
    """Command R (``CohereForCausalLM``); constructor and pipeline stages as :class:`LlamaForCausalLM`.

    Raises:
        ValueError: ``hidden_act`` is not ``"silu"``, or ``attention_bias``, ``use_qk_norm``,
            ``layer_norm_eps`` or ``logit_scale`` of the wrong type.
    """

    interleaved_rope = True

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, *, tie_word_embeddings: bool,
                 quantization: Quantization | None = None) -> None:
        super().__init__(config, ctx, dtype, tie_word_embeddings=tie_word_embeddings, quantization=quantization)
        self.logit_scale = config.hf_value("logit_scale", 0.0625, float)

    @classmethod
    def biases(cls, config: ModelConfig) -> Biases:
        """``attention_bias`` (default False) on q/k/v and o_proj; never on the MLP."""
        attention_bias = config.hf_value("attention_bias", False)
        return Biases(qkv=attention_bias, o_proj=attention_bias)

    def final_norm(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype) -> nn.Module:
        return LayerNorm(config.hidden_size, layer_norm_eps(config), bias=False, dtype=dtype, device=ctx.device)

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        biases = self.biases(config)
        attention = CohereAttention(config, ctx, dtype, quantization, biases,
                                    sliding_window=config.layer_sliding_window(layer_index))
        return CohereDecoderLayer(config, ctx, dtype, attention, LlamaMLP(config, ctx, dtype, quantization))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden (N, hidden_size)`` -> ``lm_head(hidden) * logit_scale`` ``(N, vocab_size)`` on rank 0."""
        logits = super().compute_logits(hidden)  # (N, vocab_size) on rank 0, else None
        return None if logits is None else logits * self.logit_scale
