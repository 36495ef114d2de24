"""Llama 4 text (``Llama4ForCausalLM``, ``Llama4TextConfig``): chunked local attention, NoPE layers, top-1 sigmoid MoE.

Reference: ``transformers``' ``modeling_llama4.py`` (the text stack of Llama 4 Scout and
Maverick). For a flat batch of ``T`` tokens on one rank, per layer ``i``:

    x = rms_norm(h);  q, k, v = qkv_proj(x)                   column-parallel by head
    RoPE layers (no_rope_layers[i] = 1; three of four by default):
        q, k = l2_norm(rope(q)), l2_norm(rope(k))             rope on interleaved pairs (complex product);
                                                              l2_norm (weightless RMSNorm) when use_qk_norm
        attention within the token's chunk                    positions p - p % attention_chunk_size .. p
                                                              (layer_types "chunked_attention")
    NoPE layers (no_rope_layers[i] = 0):
        q = q * (1 + attn_scale * log1p(floor((p + 1) / floor_scale)))   attn_temperature_tuning
        causal attention over the whole context
    h = h + o_proj(attention(q, k, v))                        scale head_dim ** -0.5, all-reduce
    h = h + feed_forward(rms_norm(h))
        MoE layers (every interleave_moe_layer_step-th, or moe_layers):
            s, e = sigmoid(top_k(router(x)))                  top-1 by default; s in x's dtype
            y = shared_expert(x) + sum_j expert_{e_j}(s_j * x)   the score scales the expert's INPUT
        the others: down(silu(gate(x)) * up(x)), intermediate_size_mlp wide
    logits = lm_head(rms_norm(h))

NoPE here is a branch of the attention's forward, not worker/layers/nope.py (SmolLM3, EXAONE 4):
Llama 4 rotates interleaved pairs and L2-normalises q and k after the rotation, where that layer
normalises per head before a rotate-half rotation. Chunked attention is :class:`worker.attention.PagedAttention`'s
``attention_chunk_size`` (every attention path). The experts are stored fused in the
checkpoint, ``experts.gate_up_proj (E, H, 2I)`` (``[gate | up]`` along the last axis) and
``experts.down_proj (E, I, H)``; :class:`Llama4Experts` reads this rank's slice of ``I``
from them into :class:`~worker.layers.moe.FusedMoE`'s layout. Tensor parallelism splits
heads, the MLPs' and every expert's intermediate width; the router is replicated.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tpserve.model_config import CHUNKED_ATTENTION, ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata, PagedAttention, write_kv_cache
from worker.layers.linear import QKVParallelLinear, RowParallelLinear
from worker.layers.moe import FusedMoE, ReplicatedGate, SharedExpertMLP, router_logits
from worker.layers.norm import RMSNorm
from worker.layers.rotary import apply_rotary_interleaved
from worker.layers.weights import CheckpointSource, check_shape, copy_into
from worker.models.base import KVCache
from worker.models.llama import LlamaForCausalLM, LlamaMLP, Rope
from worker.parallel_state import ParallelContext


def rope_layers(config: ModelConfig) -> list[bool]:
    """Per layer, whether it rotates (``no_rope_layers[i] == 1``); default: every ``no_rope_layer_interval``-th not."""
    flags = config.hf_value("no_rope_layers", None, list)
    if not flags:
        interval = config.hf_value("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(config.num_hidden_layers)]
    if len(flags) != config.num_hidden_layers:
        raise ValueError(f"config.json no_rope_layers must list one flag per layer ({config.num_hidden_layers})")
    return [bool(flag) for flag in flags]


def chunked_layers(config: ModelConfig) -> list[bool]:
    """Per layer, whether it attends within chunks: ``layer_types``, else ``Llama4TextConfig``'s default
    (the RoPE layers, when ``attention_chunk_size`` is set)."""
    if "layer_types" in config.hf_config:
        return [t == CHUNKED_ATTENTION for t in config.layer_types]
    chunked = config.hf_config.get("attention_chunk_size", 8192) is not None  # null: no chunked layer
    return [rope and chunked for rope in rope_layers(config)]


def moe_layers(config: ModelConfig) -> set[int]:
    """The MoE layers: ``moe_layers``, else every ``interleave_moe_layer_step``-th (``Llama4TextConfig``)."""
    listed = config.hf_value("moe_layers", None, list)
    if listed is not None:
        return set(listed)
    step = config.hf_value("interleave_moe_layer_step", 1)
    return set(range(step - 1, config.num_hidden_layers, step))


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps)`` over the last axis in float32, cast back (``Llama4TextL2Norm``)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(nn.Module):
    """One layer's attention on this rank's heads: a RoPE layer (QK L2 norm, chunked) or a NoPE layer (temperature)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None, *, use_rope: bool, chunked: bool) -> None:
        super().__init__()
        d = config.head_dim
        bias = config.hf_value("attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.total_num_heads, config.total_num_kv_heads,
                                          ctx, bias=bias, dtype=dtype, quantization=quantization)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.total_num_heads * d, config.hidden_size, ctx, bias=bias, dtype=dtype,
                                        quantization=quantization)
        self.use_rope = use_rope
        self.qk_norm_eps = config.rms_norm_eps if use_rope and config.hf_value("use_qk_norm", True) else None
        self.temperature_tuning = not use_rope and config.hf_value("attn_temperature_tuning", True)
        self.floor_scale = config.hf_value("floor_scale", 8192, (int, float))
        self.attn_scale = config.hf_value("attn_scale", 0.1, float)
        chunk = config.hf_value("attention_chunk_size", 8192) if chunked else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, scale=d**-0.5, attention_chunk_size=chunk)

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (T, (num_heads + 2 * num_kv_heads) * d)
        q, k, v = qkv.view(qkv.shape[0], -1, self.attn.head_size).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)  # (T, heads, d) each
        if self.use_rope:
            q, k = apply_rotary_interleaved(q, *rope), apply_rotary_interleaved(k, *rope)
        if self.qk_norm_eps is not None:
            q, k = l2_norm(q, self.qk_norm_eps), l2_norm(k, self.qk_norm_eps)
        if self.temperature_tuning:  # Nakanishi 2025, arXiv:2501.19399: sharper softmax far into the context
            positions = attn_metadata.positions.float()  # (T,)
            scales = torch.log1p(torch.floor((positions + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            q = (q * scales.view(-1, 1, 1)).to(q.dtype)  # (T, num_heads, d)
        write_kv_cache(k, v, *kv_cache, attn_metadata.slot_mapping, self.attn.kv_scales)
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (T, num_heads * d)
        return self.o_proj(o)  # (T, hidden), all-reduced over ranks


class Llama4Experts(FusedMoE):
    """:class:`FusedMoE` filled from Llama 4's fused checkpoint tensors (one per layer, not one per expert).

    ``gate_up_proj (E, H, 2I)``: this rank's columns ``[r I/tp, (r+1) I/tp)`` of the gate half
    and of the up half, transposed into ``(E, 2 I/tp, H)``; ``down_proj (E, I, H)``: its rows
    of ``I``, transposed into ``(E, H, I/tp)``.
    """

    loads_int8 = False  # the fused layout is filled into float stacks only
    checkpoint_layout = "Llama 4's fused expert tensors"  # what a refusal names

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ctx: ParallelContext, *,
                 dtype: torch.dtype, quantization: Quantization | None = None) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, ctx, dtype=dtype, quantization=quantization)
        self.gate_up_proj.shard_ids = self.down_proj.shard_ids = (None,)  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """Copy this rank's slice of every expert from a fused ``(E, H, 2I)`` or ``(E, I, H)`` tensor."""
        local, full, hidden = self.intermediate_size_per_partition, self.intermediate_size, self.hidden_size
        start, experts = self.ctx.tp_rank * local, slice(None)
        if param is self.down_proj:
            check_shape(source, (self.num_experts, full, hidden))
            copy_into(param.data, source[experts, start:start + local, :].transpose(1, 2))  # (E, H, I/tp)
            return
        check_shape(source, (self.num_experts, hidden, 2 * full))
        gate = source[experts, :, start:start + local]  # (E, H, I/tp)
        up = source[experts, :, full + start:full + start + local]
        copy_into(param.data, torch.cat([gate, up], dim=2).transpose(1, 2))  # (E, 2 I/tp, H)


class Llama4MoE(nn.Module):
    """Router (top-k, sigmoid), routed experts fed the score-scaled input, and an always-on shared expert.

    Shapes: ``x (T, H) -> (T, H)``, ``x.dtype``, all-reduced over ranks (one all-reduce: the
    experts and the shared expert each leave this rank's partial sum).
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None) -> None:
        super().__init__()
        num_experts = config.hf_value("num_local_experts", 16)
        self.top_k = config.hf_value("num_experts_per_tok", 1)
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_local_experts={num_experts}]")
        self.ctx = ctx
        self.router = ReplicatedGate(config.hidden_size, num_experts, ctx, dtype)
        self.experts = Llama4Experts(num_experts, config.hidden_size, config.intermediate_size, ctx, dtype=dtype,
                                     quantization=quantization)
        self.shared_expert = SharedExpertMLP(config.hidden_size, config.intermediate_size, ctx, dtype, quantization)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = router_logits(x, self.router.weight)  # (T, E), batch-invariant
        top = torch.sort(logits, dim=-1, descending=True, stable=True)  # ties: the lower expert first
        ids = top.indices[:, :self.top_k]  # (T, k)
        scores = torch.sigmoid(top.values[:, :self.top_k].float()).to(x.dtype)  # (T, k)
        ones = torch.ones_like(scores[:, :1])  # (T, 1): the score already scaled the input
        y = self.shared_expert(x)  # (T, H), this rank's partial
        for j in range(self.top_k):
            y = y + self.experts(x * scores[:, j:j + 1], ids[:, j:j + 1], ones)  # (T, H), partial
        return self.ctx.all_reduce(y)  # (T, H), summed over ranks


class Llama4DecoderLayer(nn.Module):
    """Pre-norm block: ``self_attn`` then ``feed_forward`` (a :class:`Llama4MoE` or a dense SwiGLU MLP)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, self_attn: nn.Module,
                 feed_forward: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=ctx.device)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                                                device=ctx.device)
        self.feed_forward = feed_forward

    def forward(self, rope: Rope, h: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        a = self.self_attn(rope, self.input_layernorm(h), kv_cache, attn_metadata)  # (T, hidden)
        h, x = self.post_attention_layernorm.add_and_norm(h, a)
        return h + self.feed_forward(x)  # (T, hidden)


class Llama4ForCausalLM(LlamaForCausalLM):
    """Llama 4 text; constructor and pipeline stages as :class:`LlamaForCausalLM`.

    Raises:
        ValueError: ``hidden_act`` is not ``"silu"``, ``no_rope_layers`` of the wrong length,
            ``num_experts_per_tok`` out of range, a family key of the wrong type, or
            ``--quantization`` (the fused experts are float only).
    """

    interleaved_rope = True

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        attention = Llama4Attention(config, ctx, dtype, quantization, use_rope=rope_layers(config)[layer_index],
                                    chunked=chunked_layers(config)[layer_index])
        if layer_index in moe_layers(config):
            feed_forward: nn.Module = Llama4MoE(config, ctx, dtype, quantization)
        else:
            mlp_size = config.hf_value("intermediate_size_mlp", 16384)
            feed_forward = LlamaMLP(dataclasses.replace(config, intermediate_size=mlp_size), ctx, dtype, quantization)
        return Llama4DecoderLayer(config, ctx, dtype, attention, feed_forward)
