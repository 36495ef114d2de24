"""Qwen3-Next: a hybrid of Gated DeltaNet (linear attention) and gated full attention, with shared-expert MoE MLPs.

Reference: ``transformers``' ``modeling_qwen3_next.py``. For a flat batch of ``T`` tokens on one rank:

    h = embed(input_ids)
    for each layer i:
        x = norm(h)                                              zero-centred RMSNorm: x / rms(x) * (1 + w)
        h = h + gated_delta_net(x)      if layer_types[i] == "linear_attention"   (worker/layers/gated_delta_net.py)
        h = h + gated_attention(x)      if layer_types[i] == "full_attention"
        h = h + mlp_i(norm(h))                                   one all-reduce either way
                 mlp_i = moe(x) + sigmoid(x . w_g) * shared_expert(x)   sparse layers (worker/layers/moe.py)
                 mlp_i = down(silu(gate(x)) * up(x))                     the others (``intermediate_size``)
    h = norm(h); logits = lm_head(h)

    gated_attention(x):  q, gate = q_proj(x) per head [q (d) | gate (d)]        column-parallel by head
                         q, k = rope(q_norm(q)), rope(k_norm(k))                 first ``rotary_dim`` dims only
                         o = o_proj(attention(q, k, v) * sigmoid(gate))          row-parallel, all-reduce

By default every fourth layer is full attention (``full_attention_interval``), the others Gated DeltaNet;
``layer_types`` says which. A linear-attention layer's entry of the model's ``kv_caches`` is its state tuple
``(conv, recurrent)`` (worker/state_metadata.py), read with the step's ``attn_metadata.state``; an attention
layer's is its ``(k_cache, v_cache)``. Config keys read here: ``linear_*`` (the DeltaNet sizes),
``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``shared_expert_intermediate_size``,
``norm_topk_prob`` (default true), ``decoder_sparse_step``, ``mlp_only_layers``, ``attention_bias``;
RoPE rotates ``partial_rotary_factor`` (default 0.25) of each head.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.hybrid_layers import LINEAR_ATTENTION
from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata, PagedAttention
from worker.layers.gated_delta_net import GatedDeltaNet, GatedDeltaNetSizes, GroupedProjectionGatedDeltaNet
from worker.layers.linear import QKVParallelLinear, RowParallelLinear
from worker.layers.moe import QWEN_EXPERT_NAMES, SparseMoeBlock, expert_checkpoint_name, expert_weight_map, \
    is_sparse_layer
from worker.layers.norm import ZeroCentredRMSNorm
from worker.layers.partial_rotary import rotate_partial_and_cache
from worker.models.base import KVCache, ShardId
from worker.models.llama import LlamaForCausalLM, LlamaMLP, Rope
from worker.parallel_state import ParallelContext


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate per head, QK-norm (zero-centred) and partial RoPE, on this rank's heads.

    The checkpoint's ``q_proj (2 * num_heads * d, H)`` holds per head ``[query (d) | gate (d)]``; it is loaded
    as the query part of a fused :class:`QKVParallelLinear` of ``2 * num_heads`` heads of ``d``, so a rank
    reads whole heads with their gates. Shapes: ``x (T, hidden) -> (T, hidden)``, all-reduced.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None = None) -> None:
        super().__init__()
        d = config.head_dim
        bias = config.hf_value("attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, 2 * config.total_num_heads, config.total_num_kv_heads,
                                          ctx, bias=bias, dtype=dtype, quantization=quantization)
        self.num_heads = self.qkv_proj.num_heads // 2  # query heads on this rank (each with its gate)
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.rotary_dim = config.rotary_dim or d
        self.q_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps, dtype=dtype, device=ctx.device)
        self.k_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps, dtype=dtype, device=ctx.device)
        self.o_proj = RowParallelLinear(config.total_num_heads * d, config.hidden_size, ctx, bias=bias, dtype=dtype,
                                        quantization=quantization)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, scale=d**-0.5)

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        t, d, h, kvh = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)  # (T, 2 * h * d + 2 * kvh * d)
        q, gate = qkv[:, :2 * h * d].view(t, h, 2 * d).split([d, d], dim=2)  # (T, h, d) each
        k, v = qkv[:, 2 * h * d:].split([kvh * d, kvh * d], dim=1)  # (T, kvh * d) each
        q, k = self.q_norm(q), self.k_norm(k.view(t, kvh, d))  # each head normalised
        qkv = torch.cat([q.reshape(t, h * d), k.reshape(t, kvh * d), v], dim=1)  # (T, (h + 2 kvh) * d)
        q, k, v = rotate_partial_and_cache(qkv, *rope, *kv_cache, attn_metadata.slot_mapping, h, kvh,
                                           self.rotary_dim, kv_scales=self.attn.kv_scales)  # leading rotary_dim dims rotated; k, v cached
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (T, h * d)
        return self.o_proj(o * torch.sigmoid(gate.reshape(t, h * d)))  # (T, hidden), all-reduced over ranks


class HybridDecoderLayer(nn.Module):
    """Pre-norm residual block whose token mixer is Gated DeltaNet (``linear_attn``) or attention (``self_attn``)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, mixer: nn.Module,
                 mlp: nn.Module) -> None:
        super().__init__()
        eps, size = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = ZeroCentredRMSNorm(size, eps, dtype=dtype, device=ctx.device)
        self.linear_attn: GatedDeltaNet | None = mixer if isinstance(mixer, GatedDeltaNet) else None
        self.self_attn: nn.Module | None = None if isinstance(mixer, GatedDeltaNet) else mixer
        self.post_attention_layernorm = ZeroCentredRMSNorm(size, eps, dtype=dtype, device=ctx.device)
        self.mlp = mlp

    def forward(self, rope: Rope, h: torch.Tensor, cache: tuple[torch.Tensor, ...],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        x = self.input_layernorm(h)  # (T, hidden)
        if self.linear_attn is not None:
            if attn_metadata.state is None:
                raise ValueError("a Gated DeltaNet layer needs the step's StateMetadata (attn_metadata.state)")
            a = self.linear_attn(x, cache, attn_metadata.state)  # (T, hidden); the state updated at its slots
        else:
            assert self.self_attn is not None  # one of the two, by construction
            a = self.self_attn(rope, x, cache, attn_metadata)  # (T, hidden)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h))  # (T, hidden)


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """The Qwen3-Next causal LM; constructor as :class:`LlamaForCausalLM`.

    Raises:
        ValueError: a bad DeltaNet or MoE config value, or DeltaNet heads not divisible by
            ``tensor_parallel_size`` (named); ``--quantization int4`` on the experts.
    """

    supports_pipeline = False  # the state layers' pool is not split by stage yet
    #: The layout of the DeltaNet input projections in the checkpoint (worker/layers/gated_delta_net.py).
    delta_net_class: type[GatedDeltaNet] = GroupedProjectionGatedDeltaNet

    def final_norm(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype) -> nn.Module:
        return ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=ctx.device)

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        mixer: nn.Module
        if config.layer_types[layer_index] == LINEAR_ATTENTION:
            mixer = self.delta_net_class(GatedDeltaNetSizes.from_config(config), ctx, dtype, quantization)
        else:
            mixer = GatedAttention(config, ctx, dtype, quantization)
        return HybridDecoderLayer(config, ctx, dtype, mixer, self.mlp(config, ctx, dtype, quantization, layer_index))

    def mlp(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, quantization: Quantization | None,
            layer_index: int) -> nn.Module:
        """Layer ``layer_index``'s MLP: shared-expert MoE where Qwen-MoE's rule makes it sparse, else dense."""
        num_experts = config.hf_value("num_experts", 512)
        if not is_sparse_layer(layer_index, num_experts, config.hf_value("decoder_sparse_step", 1),
                               config.hf_value("mlp_only_layers", [])):
            return LlamaMLP(config, ctx, dtype, quantization)
        return self.moe(config, ctx, dtype, quantization, renormalize=config.hf_value("norm_topk_prob", True))

    @staticmethod
    def moe(config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, quantization: Quantization | None, *,
            renormalize: bool) -> SparseMoeBlock:
        """The sparse block: softmax top-k routing plus a shared expert behind its sigmoid gate (one all-reduce)."""
        return SparseMoeBlock(
            config.hidden_size, config.hf_value("num_experts", 512), config.hf_value("num_experts_per_tok", 10),
            config.hf_value("moe_intermediate_size", 512), ctx, dtype, renormalize=renormalize, weights_in_dtype=True,
            shared_expert_intermediate_size=config.hf_value("shared_expert_intermediate_size", 512),
            quantization=quantization,
        )

    def state_layers(self) -> dict[int, nn.Module]:
        """The Gated DeltaNet layers, by index: each one's state is ``(conv, recurrent)`` (its ``state_shapes()``)."""
        return {i: layer.linear_attn for i, layer in enumerate(self.model.layers)
                if isinstance(layer.linear_attn, GatedDeltaNet)}

    def stage_checkpoint_name(self, checkpoint_name: str) -> str | None:
        if checkpoint_name.startswith("mtp."):
            return None  # the multi-token-prediction layer (for speculative decoding): not served, not read
        return super().stage_checkpoint_name(checkpoint_name)

    def weight_map(self, checkpoint_name: str) -> tuple[str, ShardId] | None:
        mapped = expert_weight_map(checkpoint_name, QWEN_EXPERT_NAMES)  # shard (expert, part): worker/layers/moe.py
        return mapped if mapped is not None else super().weight_map(checkpoint_name)  # type: ignore[return-value]

    def checkpoint_name(self, param_name: str, shard_id: ShardId) -> str:
        return expert_checkpoint_name(param_name, shard_id, QWEN_EXPERT_NAMES) or super().checkpoint_name(
            param_name, shard_id)
