"""NVIDIA Nemotron-H (``NemotronHForCausalLM``): a stack of single-mixer blocks, Mamba-2, attention, MLP or MoE.

Reference: ``transformers``' ``modeling_nemotron_h.py``. For a flat batch of ``T`` tokens on one rank:

    h = embed(input_ids)                                   vocab-parallel, all-reduce
    for each block i (hybrid_override_pattern[i]):
        h = h + mixer_i(rms_norm(h))                       one all-reduce per block
            "M": Mamba-2 (worker/layers/mamba2.py)          a state layer
            "*": attention, no positional encoding          scale head_dim ** -0.5, no biases
            "-": down_proj(relu(up_proj(x)) ** 2)           mlp_hidden_act "relu2", ``intermediate_size``
            "E": sum over top-k experts e of w_e * expert_e(x) + shared_expert(x)
                 experts and shared expert are relu^2 MLPs (no gate); the router is DeepSeek V3's
                 biased sigmoid (worker/layers/moe_routing.py: ``e_score_correction_bias``, ``n_group``,
                 ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``)
    h = rms_norm(h); logits = lm_head(h)

Norms are RMSNorm with ``layer_norm_epsilon``; the Mamba-2 keys are ``mamba_num_heads``,
``mamba_head_dim``, ``n_groups``, ``ssm_state_size``, ``conv_kernel``, ``chunk_size``,
``use_conv_bias``, ``use_bias`` (in_proj and out_proj), ``time_step_limit`` (older configs'
``mamba_n_groups``, ``mamba_d_conv``, ``mamba_chunk_size``, ``mamba_conv_bias``, ``mamba_dt_limit``
too); the latent MoE projection (``moe_latent_size``) is refused at start-up
(tpserve/model_config_rules.py). Checkpoint names: ``backbone.embeddings.weight``,
``backbone.layers.{i}.norm.weight``, ``backbone.layers.{i}.mixer.*``, ``backbone.norm_f.weight``,
``lm_head.weight``; experts ``mixer.experts.{e}.up_proj/down_proj.weight``.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata
from worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker.layers.mamba2 import Mamba2Mixer, Mamba2Spec, mamba2_time_step_limit
from worker.layers.moe import QWEN_EXPERT_NAMES, FusedMoE, expert_checkpoint_name, expert_weight_map
from worker.layers.moe_routing import BiasedRouting, BiasedTopKRouter, deepseek_routing
from worker.layers.nope import position_and_cache
from worker.layers.norm import RMSNorm
from worker.layers.weights import CheckpointSource, check_shape, copy_into, new_parameter, read_narrow
from worker.models.base import LLAMA_STACKED_PARAMS, CausalLM, KVCache, ShardId
from worker.models.llama import Biases, LlamaAttention
from worker.parallel_state import ParallelContext

#: Only q/k/v are stacked (``up_proj`` is a whole MLP's here, not the gate/up pair's second half).
_QKV_STACKED = tuple(entry for entry in LLAMA_STACKED_PARAMS if entry[0] == "qkv_proj")


class ReLUSquared(nn.Module):
    """``relu(x) ** 2`` (So et al. 2021, "Primer", arXiv:2109.08668; ``transformers``' ``"relu2"``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(x))


def nemotron_h_mamba2_spec(config: ModelConfig) -> Mamba2Spec:
    """The Mamba-2 sizes of a ``NemotronHConfig`` (its defaults, and its older key names, where absent)."""
    def key(name: str, old: str, default: int) -> int:
        return config.hf_value(name, config.hf_value(old, default))

    limit = config.hf_config.get("time_step_limit", config.hf_config.get("mamba_dt_limit"))
    return Mamba2Spec(
        hidden_size=config.hidden_size, num_heads=config.hf_value("mamba_num_heads", 128),
        head_dim=config.hf_value("mamba_head_dim", 64), n_groups=key("n_groups", "mamba_n_groups", 8),
        d_state=config.hf_value("ssm_state_size", 128), conv_kernel=key("conv_kernel", "mamba_d_conv", 4),
        chunk_size=key("chunk_size", "mamba_chunk_size", 128), norm_eps=config.hf_value("layer_norm_epsilon", 1e-5),
        time_step_limit=mamba2_time_step_limit(limit), conv_bias=config.hf_value("use_conv_bias", config.hf_value("mamba_conv_bias", True)),
        proj_bias=config.hf_value("use_bias", False), heads_key="mamba_num_heads", groups_key="n_groups")


class NemotronHMLP(nn.Module):
    """``down_proj(relu(up_proj(x)) ** 2)``: column- then row-parallel; ``reduce``: all-reduce the output
    (False: leave this rank's partial, a MoE block's shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int, ctx: ParallelContext, dtype: torch.dtype, *,
                 bias: bool, reduce: bool = True) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, ctx, bias=bias, dtype=dtype)
        self.act = ReLUSquared()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, ctx, bias=bias, dtype=dtype,
                                           reduce_results=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))  # (T, hidden)


class NemotronHExperts(FusedMoE):
    """Experts without a gate: ``gate_up_proj (E, I/tp, H)`` holds each expert's ``up_proj`` rows only,
    and the activation is relu^2 of them (the experts path applies ``act`` to whatever width it is given)."""

    loads_int8 = False

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ctx: ParallelContext,
                 dtype: torch.dtype) -> None:
        if ctx.enable_expert_parallel:
            raise ValueError("--enable-expert-parallel is not supported for Nemotron-H's experts; serve them "
                             "tensor-parallel")
        super().__init__(num_experts, hidden_size, intermediate_size, ctx, dtype=dtype, activation=ReLUSquared())
        local = self.intermediate_size_per_partition
        self.gate_up_proj = new_parameter((num_experts, local, hidden_size), dtype, ctx.device, self.weight_loader)
        self.gate_up_proj.shard_ids = tuple((e, "up") for e in range(num_experts))  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """Expert ``e``'s ``up_proj`` rows (this rank's ``I / tp``), or its ``down_proj`` columns (FusedMoE's)."""
        expert, kind = cast(tuple[int, str], shard_id)
        if kind != "up":
            super().weight_loader(param, source, shard_id)
            return
        local = self.intermediate_size_per_partition
        check_shape(source, (self.intermediate_size, self.hidden_size))
        copy_into(param.data[expert], read_narrow(source, 0, self.ctx.tp_rank * local, local))


class NemotronHMoE(nn.Module):
    """Biased sigmoid router, relu^2 experts and the relu^2 shared expert, in one all-reduce: ``(T, H) -> (T, H)``."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx = ctx
        num_experts = config.hf_value("n_routed_experts", 8)
        routing = deepseek_routing(config, num_experts, BiasedRouting(top_k=2))
        self.gate = BiasedTopKRouter(config.hidden_size, num_experts, routing, ctx, dtype)
        self.experts = NemotronHExperts(num_experts, config.hidden_size, config.hf_value("moe_intermediate_size", 7688),
                                        ctx, dtype)
        self.shared_experts = NemotronHMLP(config.hidden_size,
                                           config.hf_value("moe_shared_expert_intermediate_size", 7688), ctx, dtype,
                                           bias=config.hf_value("mlp_bias", False), reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # (T, k) float32, (T, k) int64
        y = self.ctx.all_reduce(self.experts(x, ids, weights) + self.shared_experts(x))  # (T, H): partials summed
        bias = self.shared_experts.down_proj.bias  # (H,) or None: reduce=False left it to the caller, added once
        return y if bias is None else y + bias


class NemotronHAttention(LlamaAttention):
    """Attention without positional encoding (``transformers``' ``NemotronHAttention``): no biases, scale
    ``head_dim ** -0.5``, keys cached as projected (in an 8-bit cache with the layer's scales)."""

    def forward(self, x: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:  # type: ignore[override]
        qkv = self.qkv_proj(x)  # (T, (num_heads + 2 * num_kv_heads) * d)
        q, k, v = position_and_cache(qkv, None, *kv_cache, attn_metadata.slot_mapping, self.num_heads,
                                     self.num_kv_heads, kv_scales=self.attn.kv_scales)  # k, v in the cache
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (T, num_heads * d)
        return self.o_proj(o)  # (T, hidden), all-reduced over ranks


class NemotronHBlock(nn.Module):
    """``h + mixer(rms_norm(h))``, the mixer one of the four kinds (``config.layer_types[i]``)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, layer_index: int) -> None:
        super().__init__()
        kind = config.layer_types[layer_index]
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, config.hf_value("layer_norm_epsilon", 1e-5), dtype=dtype,
                            device=ctx.device)
        self.mixer: nn.Module
        if kind == "linear_attention":
            self.mixer = Mamba2Mixer(nemotron_h_mamba2_spec(config), ctx, dtype)
        elif kind == "full_attention":
            self.mixer = NemotronHAttention(config, ctx, dtype, None, Biases())
        elif kind == "mlp":
            self.mixer = NemotronHMLP(config.hidden_size, config.intermediate_size, ctx, dtype,
                                      bias=config.hf_value("mlp_bias", False))
        else:  # "moe" (tpserve/hybrid_layers.py admits nothing else)
            self.mixer = NemotronHMoE(config, ctx, dtype)

    def forward(self, h: torch.Tensor, cache: tuple[torch.Tensor, ...], attn_metadata: AttentionMetadata) -> torch.Tensor:
        x = self.norm(h)  # (T, hidden)
        if self.kind == "linear_attention":
            assert attn_metadata.state is not None, "a Mamba-2 layer needs the step's StateMetadata"
            return h + self.mixer(x, cache, attn_metadata.state)
        if self.kind == "full_attention":
            return h + self.mixer(x, cache, attn_metadata)
        return h + self.mixer(x)  # (T, hidden)


class NemotronHModel(nn.Module):
    """Embedding, the blocks and ``norm_f`` (checkpoint prefix ``backbone.``)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx, dtype=dtype)
        self.layers = nn.ModuleList([NemotronHBlock(config, ctx, dtype, i) for i in range(config.num_hidden_layers)])
        self.norm_f = RMSNorm(config.hidden_size, config.hf_value("layer_norm_epsilon", 1e-5), dtype=dtype,
                              device=ctx.device)

    def forward(self, input_ids: torch.Tensor, caches: list[KVCache], attn_metadata: AttentionMetadata) -> torch.Tensor:
        h = self.embeddings(input_ids)  # (T, hidden), all-reduced over ranks
        for layer, cache in zip(self.layers, caches, strict=True):
            h = layer(h, cache, attn_metadata)  # (T, hidden)
        return self.norm_f(h)  # (T, hidden)


class NemotronHForCausalLM(CausalLM):
    """Nemotron-H: :class:`NemotronHModel` and a vocab-parallel LM head (tied when the config says so).

    Args: those of :class:`~worker.models.base.CausalLM`.

    Raises:
        ValueError: a bad Mamba-2 or MoE value (named), heads or groups that do not split over the ranks,
            or ``--quantization`` (the Mamba-2 and expert weights are float).
    """

    stacked_params_mapping = _QKV_STACKED

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, *, tie_word_embeddings: bool,
                 quantization: Quantization | None = None) -> None:
        super().__init__()
        if quantization is not None:
            raise ValueError(f"--quantization {quantization} is not supported for {config.architecture} "
                             "(Mamba-2 and expert weights); serve it unquantized")
        self.config = config
        self.quantization = quantization
        self.backbone = NemotronHModel(config, ctx, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx, dtype=dtype)
        self.tie_word_embeddings = tie_word_embeddings
        if tie_word_embeddings:
            self.lm_head.tie_to(self.backbone.embeddings)

    def state_layers(self) -> dict[int, nn.Module]:
        """The Mamba-2 blocks' mixers, by layer index."""
        return {i: layer.mixer for i, layer in enumerate(self.backbone.layers) if isinstance(layer.mixer, Mamba2Mixer)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids (T,) int64`` -> final hidden states ``(T, hidden_size)`` (no positional encoding:
        ``positions`` are only the cache's business, through ``attn_metadata``)."""
        return self.backbone(input_ids, kv_caches, attn_metadata)  # (T, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden (N, hidden_size)`` -> ``(N, vocab_size)`` on rank 0, else None (a collective)."""
        return self.lm_head(hidden)

    def weight_map(self, checkpoint_name: str) -> tuple[str, ShardId] | None:
        if checkpoint_name.startswith("mtp."):
            return None  # multi-token prediction layers: not served (transformers skips them too)
        mapped = expert_weight_map(checkpoint_name, QWEN_EXPERT_NAMES)
        return cast(tuple[str, ShardId], mapped) if mapped is not None else super().weight_map(checkpoint_name)

    def checkpoint_name(self, param_name: str, shard_id: ShardId) -> str:
        return expert_checkpoint_name(param_name, shard_id, QWEN_EXPERT_NAMES) or super().checkpoint_name(
            param_name, shard_id)
