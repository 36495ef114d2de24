"""IBM Granite 4 hybrid (``GraniteMoeHybridForCausalLM``): Mamba-2 and attention layers, MoE or dense MLPs.

Reference: ``transformers``' ``modeling_granitemoehybrid.py``. For a flat batch of ``T`` tokens on one rank:

    h = embed(input_ids) * embedding_multiplier
    for each layer i:
        x = rms_norm(h)
        h = h + residual_multiplier * mamba(x)                 layer_types[i] "mamba" (worker/layers/mamba2.py)
        h = h + residual_multiplier * attention(q, k, v)       layer_types[i] "attention": Granite's attention,
                                                               softmax scale attention_multiplier; RoPE only
                                                               when position_embedding_type is "rope" (else NoPE)
        x = rms_norm(h)
        h = h + residual_multiplier * (moe(x) + shared_mlp(x))  num_local_experts > 0: one all-reduce
        h = h + residual_multiplier * shared_mlp(x)              num_local_experts == 0 (dense)
    h = rms_norm(h); logits = lm_head(h) / logits_scaling

``moe``: softmax over the top ``num_experts_per_tok`` router logits (the same as the softmax over
every expert renormalised over the chosen ones), SwiGLU experts of ``intermediate_size``;
``shared_mlp``: a SwiGLU of ``shared_intermediate_size``. The Mamba-2 keys (``mamba_n_heads``,
``mamba_d_head``, ``mamba_n_groups``, ``mamba_d_state``, ``mamba_d_conv``, ``mamba_expand``,
``mamba_chunk_size``, ``mamba_conv_bias``, ``mamba_proj_bias``, ``time_step_limit``) are checked at
start-up (tpserve/model_config_rules.py). A Mamba layer's entry of ``kv_caches`` is its state tuple
and it reads the step's :class:`~worker.state_metadata.StateMetadata` from ``attn_metadata.state``.

Checkpoint names under ``model.layers.{i}.``: ``mamba.*`` (the mixer's), ``self_attn.{q,k,v,o}_proj``,
``block_sparse_moe.router.layer.weight`` ``(E, H)``, ``block_sparse_moe.input_linear.weight`` ``(E, 2I, H)``
(``[gate | up]`` rows), ``block_sparse_moe.output_linear.weight`` ``(E, H, I)``,
``shared_mlp.input_linear.weight`` ``(2 I_s, H)`` and ``shared_mlp.output_linear.weight``.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata
from worker.layers.mamba2 import Mamba2Mixer, Mamba2Spec, mamba2_time_step_limit
from worker.layers.moe import FusedMoE, SharedExpertMLP, SparseMoeBlock
from worker.layers.nope import position_and_cache
from worker.layers.norm import RMSNorm
from worker.layers.weights import CheckpointSource, check_shape, copy_into
from worker.models.base import KVCache, ShardId
from worker.models.granite import GraniteAttention, GraniteForCausalLM
from worker.models.llama import Rope
from worker.parallel_state import ParallelContext

#: Checkpoint module names -> ours: (checkpoint, MoE layer, dense layer).
_RENAMES = (
    ("block_sparse_moe.router.layer.", "block_sparse_moe.gate.", None),
    ("block_sparse_moe.input_linear.weight", "block_sparse_moe.experts.gate_up_proj", None),
    ("block_sparse_moe.output_linear.weight", "block_sparse_moe.experts.down_proj", None),
    ("shared_mlp.input_linear.", "block_sparse_moe.shared_experts.gate_up_proj.", "shared_mlp.gate_up_proj."),
    ("shared_mlp.output_linear.", "block_sparse_moe.shared_experts.down_proj.", "shared_mlp.down_proj."),
)


def granite_mamba2_spec(config: ModelConfig) -> Mamba2Spec:
    """The Mamba-2 sizes of a ``GraniteMoeHybridConfig`` (its defaults where a key is absent)."""
    num_heads = config.hf_value("mamba_n_heads", 128)
    inner = config.hf_value("mamba_expand", 2) * config.hidden_size
    head_dim = config.hf_value("mamba_d_head", "auto", (int, str))
    return Mamba2Spec(
        hidden_size=config.hidden_size, num_heads=num_heads,
        head_dim=inner // num_heads if head_dim == "auto" else int(head_dim),
        n_groups=config.hf_value("mamba_n_groups", 1), d_state=config.hf_value("mamba_d_state", 256),
        conv_kernel=config.hf_value("mamba_d_conv", 4), chunk_size=config.hf_value("mamba_chunk_size", 256),
        norm_eps=config.rms_norm_eps, time_step_limit=mamba2_time_step_limit(config.hf_config.get("time_step_limit")),
        conv_bias=config.hf_value("mamba_conv_bias", True), proj_bias=config.hf_value("mamba_proj_bias", False),
        heads_key="mamba_n_heads", groups_key="mamba_n_groups")


class GraniteMoeExperts(FusedMoE):
    """:class:`FusedMoE` filled from GraniteMoe's stacked tensors: ``input_linear (E, 2I, H)`` ``[gate | up]``
    rows and ``output_linear (E, H, I)``. Tensor-parallel: this rank reads its ``I / tp`` rows of each half
    and columns of every expert; expert-parallel (``--enable-expert-parallel``): its experts, whole."""

    loads_int8 = False  # the stacked layout is filled into float stacks only

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ctx: ParallelContext, *,
                 dtype: torch.dtype) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, ctx, dtype=dtype)
        self.gate_up_proj.shard_ids = self.down_proj.shard_ids = (None,)  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """Copy this rank's slice of every expert from a stacked ``(E, 2I, H)`` or ``(E, H, I)`` tensor."""
        local, full, hidden = self.intermediate_size_per_partition, self.intermediate_size, self.hidden_size
        start = 0 if self.expert_parallel else self.ctx.tp_rank * local
        experts = slice(self.first_expert, self.first_expert + self.num_local_experts)  # all, unless expert-parallel
        if param is self.down_proj:
            check_shape(source, (self.num_experts, hidden, full))
            copy_into(param.data, source[experts, :, start:start + local])  # (E, H, I/tp)
            return
        check_shape(source, (self.num_experts, 2 * full, hidden))
        gate = source[experts, start:start + local, :]  # (E, I/tp, H)
        up = source[experts, full + start:full + start + local, :]
        copy_into(param.data, torch.cat([gate, up], dim=1))  # (E, 2 I/tp, H)


class GraniteSharedMLP(SharedExpertMLP):
    """The dense layers' SwiGLU (``shared_mlp``), all-reduced: ``(T, H) -> (T, H)``."""

    def __init__(self, hidden_size: int, intermediate_size: int, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None) -> None:
        super().__init__(hidden_size, intermediate_size, ctx, dtype, quantization)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_reduce(super().forward(x))  # (T, H)


class GraniteHybridAttention(GraniteAttention):
    """Granite's attention, rotating q and k only when the model has RoPE (``position_embedding_type``)."""

    rotate = False

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (T, (num_heads + 2 * num_kv_heads) * d)
        q, k, v = position_and_cache(qkv, rope if self.rotate else None, *kv_cache, attn_metadata.slot_mapping,
                                     self.num_heads, self.num_kv_heads, kv_scales=self.attn.kv_scales)
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (T, num_heads * d)
        return self.o_proj(o)  # (T, hidden), all-reduced over ranks


class GraniteMoeHybridDecoderLayer(nn.Module):
    """One layer: a Mamba-2 mixer or attention, then the MoE (with its shared MLP) or the dense shared MLP,
    each sub-block's output times ``residual_multiplier`` before its residual add."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None, layer_index: int, attention: GraniteHybridAttention) -> None:
        super().__init__()
        self.residual_multiplier = config.hf_value("residual_multiplier", 1.0, float)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=ctx.device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                                                device=ctx.device)
        is_mamba = config.layer_types[layer_index] == "linear_attention"
        self.mamba = Mamba2Mixer(granite_mamba2_spec(config), ctx, dtype) if is_mamba else None
        self.self_attn = None if is_mamba else attention
        num_experts = config.hf_value("num_local_experts", 8)
        shared = config.hf_value("shared_intermediate_size", 1024)
        self.block_sparse_moe = self.shared_mlp = None
        if num_experts > 0:
            experts = GraniteMoeExperts(num_experts, config.hidden_size, config.intermediate_size, ctx, dtype=dtype)
            self.block_sparse_moe = SparseMoeBlock(
                config.hidden_size, num_experts, config.hf_value("num_experts_per_tok", 2), config.intermediate_size,
                ctx, dtype, renormalize=True, weights_in_dtype=True, experts=experts,
                shared_experts_intermediate_size=shared, quantization=quantization)
        else:
            self.shared_mlp = GraniteSharedMLP(config.hidden_size, shared, ctx, dtype, quantization)

    def forward(self, rope: Rope, h: torch.Tensor, cache: tuple[torch.Tensor, ...],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        x = self.input_layernorm(h)  # (T, hidden)
        if self.mamba is not None:
            assert attn_metadata.state is not None, "a Mamba-2 layer needs the step's StateMetadata"
            a = self.mamba(x, cache, attn_metadata.state)  # (T, hidden); the layer's state updated
        else:
            a = cast(GraniteHybridAttention, self.self_attn)(rope, x, cast(KVCache, cache), attn_metadata)
        h, x = self.post_attention_layernorm.add_and_norm(h, a * self.residual_multiplier)
        ffn = cast(nn.Module, self.block_sparse_moe if self.block_sparse_moe is not None else self.shared_mlp)
        return h + ffn(x) * self.residual_multiplier  # (T, hidden)


class GraniteMoeHybridForCausalLM(GraniteForCausalLM):
    """Granite 4 hybrid: :class:`GraniteForCausalLM`'s multipliers, embedding and head around hybrid layers.

    Raises:
        ValueError: a bad Mamba-2 or MoE size (named), heads or groups that do not split over the
            tensor-parallel ranks, or ``--quantization`` (the Mamba-2 and expert weights are float).
    """

    supports_pipeline = False  # the state cache is laid out for one stage

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, *, tie_word_embeddings: bool,
                 quantization: Quantization | None = None) -> None:
        if quantization is not None:
            raise ValueError(f"--quantization {quantization} is not supported for {config.architecture} "
                             "(Mamba-2 and expert weights); serve it unquantized")
        super().__init__(config, ctx, dtype, tie_word_embeddings=tie_word_embeddings, quantization=quantization)
        self.num_experts = config.hf_value("num_local_experts", 8)

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        attention = GraniteHybridAttention(config, ctx, dtype, quantization, self.biases(config))
        attention.rotate = config.hf_value("position_embedding_type", "nope", str) == "rope"
        return GraniteMoeHybridDecoderLayer(config, ctx, dtype, quantization, layer_index, attention)

    def weight_map(self, checkpoint_name: str) -> tuple[str, ShardId] | None:
        for old, moe_new, dense_new in _RENAMES:
            if old in checkpoint_name:
                new = moe_new if self.num_experts > 0 else dense_new
                return None if new is None else (checkpoint_name.replace(old, new), None)
        return super().weight_map(checkpoint_name)

    def checkpoint_name(self, param_name: str, shard_id: ShardId) -> str:
        for old, moe_new, dense_new in _RENAMES:
            new = moe_new if self.num_experts > 0 else dense_new
            if new is not None and new in param_name:
                return param_name.replace(new, old)
        return super().checkpoint_name(param_name, shard_id)
