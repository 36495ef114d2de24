"""OLMo 2 (``Olmo2ForCausalLM``): Llama's attention and MLP with post-norms and a full-width QK norm.

Architecture (OLMo et al. 2024, arXiv:2501.00656; reference: ``transformers``'
``modeling_olmo2.py``), per layer on this rank's heads:

    q, k, v = qkv_proj(h)                                  no input norm; bias: attention_bias
    q, k = q_norm(q), k_norm(k)                            RMSNorm over ALL heads' q (resp. k) at once:
                                                           one all-reduce of the sums of squares
    h = h + post_attention_layernorm(o_proj(attention(rope(q), rope(k), v)))
    h = h + post_feedforward_layernorm(down_proj(silu(gate) * up))
    h = norm(h)                                            final norm, then the LM head

The post-norm layer is worker/layers/post_norm.py's, the full-width QK norm
worker/layers/qk_norm.py's (shared with OLMo 3, worker/models/olmo3.py). Every RMSNorm
multiplies its weight in float32 before the cast back (``Olmo2RMSNorm``;
:class:`~worker.layers.norm.Float32ScaledRMSNorm`). Config keys read here:
``attention_bias`` (q/k/v and o_proj, default False); the MLP has no bias.

RoPE rotates in float32 and rounds once (``Olmo2RotaryEmbedding`` keeps ``cos``/``sin`` in
float32, ``apply_rotary_pos_emb`` casts the result back): :class:`OlmoModel` hands the
layers float32 ``cos``/``sin`` (in float32 models, the same as Llama).

Every attention path serves it: the QK norm runs before the cache write, so the CPU
kernel, SDPA and Triton read normalised keys from the cache; the extra all-reduce is the
ranks' ordinary one (captured by CUDA graphs as o_proj's is). The compiled CPU decode
block is Llama's layer only (not this layer's order of norms), so decode runs the modules.
Pipeline stages: as Llama.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata
from worker.layers.nope import MaybeRope, position_and_cache
from worker.layers.norm import Float32ScaledRMSNorm
from worker.layers.post_norm import PostNormDecoderLayer
from worker.layers.qk_norm import FullWidthRMSNorm, full_width_qk_norm
from worker.layers.rotary import RotaryEmbedding
from worker.models.base import KVCache
from worker.models.llama import Biases, LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from worker.parallel_state import ParallelContext


class Olmo2Attention(LlamaAttention):
    """Llama attention with the full-width QK norm before RoPE (``sliding_window``: OLMo 3's local layers)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None, biases: Biases, *, sliding_window: int | None = None) -> None:
        super().__init__(config, ctx, dtype, quantization, biases, sliding_window=sliding_window)
        proj, d, eps = self.qkv_proj, config.head_dim, config.rms_norm_eps
        self.ctx = ctx
        self.q_norm = FullWidthRMSNorm(proj.total_num_heads * d, ctx.tp_rank * self.q_size, self.q_size, eps,
                                       dtype=dtype, device=ctx.device)
        self.k_norm = FullWidthRMSNorm(proj.total_num_kv_heads * d, proj.kv_head_start * d, self.kv_size, eps,
                                       dtype=dtype, device=ctx.device)

    def forward(self, rope: MaybeRope, x: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = full_width_qk_norm(self.qkv_proj(x), self.q_norm, self.k_norm, self.ctx)  # (T, (H + 2 KVH) d)
        q, k, v = position_and_cache(qkv, rope, *kv_cache, attn_metadata.slot_mapping, self.num_heads,
                                     self.num_kv_heads, kv_scales=self.attn.kv_scales)  # q, k rotated; k, v now in the cache
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (T, num_heads * d)
        return self.o_proj(o)  # (T, hidden), all-reduced over ranks


class OlmoModel(LlamaModel):
    """:class:`LlamaModel` whose layers take their layer type's RoPE, as float32 ``cos``/``sin``.

    ``layer_types``: this stage's layers' types, in order; ``ropes``: ``(rope_theta,
    rope_scaling)`` per type (OLMo 2: one type; OLMo 3: sliding and full). One rotary
    embedding per distinct pair, each computed once per step.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, layers: list[nn.Module],
                 layer_types: list[str], ropes: dict[str, tuple[float, dict[str, Any] | None]], *,
                 embedding: bool, head: bool) -> None:
        super().__init__(config, ctx, dtype, layers, embedding=embedding, head=head)
        del self.rotary_emb  # replaced by one per distinct RoPE
        distinct = list({repr(pair): pair for pair in ropes.values()}.items())
        self.rotary_embs = nn.ModuleList(
            RotaryEmbedding(config.head_dim, theta, scaling, ctx.device, max_position=config.max_model_len)
            for _, (theta, scaling) in distinct)
        keys = [key for key, _ in distinct]
        self.rope_of_layer = [keys.index(repr(ropes[t])) for t in layer_types]  # layer -> index in rotary_embs
        if self.norm is not None:  # the final norm rounds as the layers' norms do
            self.norm = Float32ScaledRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=ctx.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        # (T, hidden): embedded and all-reduced over ranks, or the previous pipeline stage's output.
        h = self.embed_tokens(input_ids) if hidden_states is None else hidden_states  # type: ignore[misc]
        ropes = [emb(positions, torch.float32, attn_metadata.rope_seq_lens)  # (T, 1, d) float32 pairs
                 for emb in self.rotary_embs]
        for layer, rope, kv_cache in zip(self.layers, self.rope_of_layer, kv_caches, strict=True):
            h = layer(ropes[rope], h, kv_cache, attn_metadata)  # (T, hidden)
        return h if self.norm is None else self.norm(h)  # (T, hidden)


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2: :class:`Olmo2Attention` and Llama's MLP in a post-norm layer; constructor and errors as Llama's."""

    @classmethod
    def biases(cls, config: ModelConfig) -> Biases:
        """``attention_bias`` on q/k/v and o_proj (default False); never on the MLP."""
        attention_bias = config.hf_value("attention_bias", False)
        return Biases(qkv=attention_bias, o_proj=attention_bias)

    def build_model(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                    layers: list[nn.Module]) -> LlamaModel:
        types = self.layer_types(config)[slice(*self.layer_range)]
        return OlmoModel(config, ctx, dtype, layers, list(types), self.ropes(config),
                         embedding=self.has_embedding, head=self.has_head)

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        window = config.sliding_window if self.layer_types(config)[layer_index] == "sliding_attention" else None
        attention = Olmo2Attention(config, ctx, dtype, quantization, self.biases(config), sliding_window=window)
        norm = partial(Float32ScaledRMSNorm, config.hidden_size, config.rms_norm_eps, dtype=dtype, device=ctx.device)
        return PostNormDecoderLayer(attention, LlamaMLP(config, ctx, dtype, quantization), norm)

    def layer_types(self, config: ModelConfig) -> tuple[str, ...]:
        """Each layer's type: OLMo 2's are all ``"full_attention"`` (OLMo 3 overrides)."""
        return ("full_attention",) * config.num_hidden_layers

    def ropes(self, config: ModelConfig) -> dict[str, tuple[float, dict[str, Any] | None]]:
        """``(rope_theta, rope_scaling)`` per layer type: OLMo 2 has one."""
        return {"full_attention": (config.rope_theta, config.rope_scaling)}
