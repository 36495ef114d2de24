"""Gemma 2, one tensor-parallel shard of it; its pieces serve Gemma 3 too (worker/models/gemma3.py).

Architecture (Gemma Team 2024, arXiv:2408.00118; reference: ``transformers``'
``modeling_gemma2.py``), for a flat batch of ``T`` tokens on one rank:

    h = embed(input_ids) * sqrt(hidden_size)               vocab-parallel, all-reduce; the scale
                                                           rounded to the model dtype first
    for each layer (local: a sliding window; global: full attention, alternating):
        a = o_proj(attention(rope(q, k), v))               scale query_pre_attn_scalar ** -0.5,
                 where q, k, v = qkv_proj(norm(h))         scores soft-capped: c * tanh(s / c)
        h = h + post_attention_norm(a)
        h = h + post_feedforward_norm(down(gelu_tanh(gate) * up))
                 where gate, up = gate_up_proj(pre_feedforward_norm(h))
    h = norm(h)
    logits = final_cap * tanh(lm_head(h) / final_cap)      tied LM head, rank 0

Every norm is Gemma's RMSNorm, ``x / rms(x) * (1 + w)`` in float32 (:class:`GemmaRMSNorm`).
The attention-logit cap (``attn_logit_softcapping``) runs inside every attention path
(worker/attention.py; the CPU and Triton kernels take it). Layer ``i`` is local when
``layer_types[i]`` says ``"sliding_attention"`` (default: even ``i``, as ``Gemma2Config``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.model_config import LAYER_TYPES, ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata, PagedAttention
from worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from worker.layers.norm import ZeroCentredRMSNorm
from worker.layers.rotary import RotaryEmbedding, rotate_and_cache
from worker.models.base import LLAMA_STACKED_PARAMS, CausalLM, KVCache
from worker.parallel_state import ParallelContext

#: One layer's RoPE ``(cos, sin)``, each ``(T, 1, head_dim)``.
Rope = tuple[torch.Tensor, torch.Tensor]
#: ``hidden_activation`` -> the ``approximate`` argument of ``F.gelu`` (transformers' ACT2FN).
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


#: Gemma's RMSNorm is the zero-centred one (worker/layers/norm.py), shared with Qwen3-Next and Qwen3.5.
GemmaRMSNorm = ZeroCentredRMSNorm


def gemma_layer_types(config: ModelConfig, pattern: int) -> tuple[str, ...]:
    """``layer_types`` of the config, or the Gemma default: every ``pattern``-th layer global.

    ``pattern`` 2 is Gemma 2's alternation (local first), 6 Gemma 3's five local to one global.
    """
    if "layer_types" in config.hf_config:
        return config.layer_types
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(config.num_hidden_layers))


class Gemma2Attention(nn.Module):
    """Self-attention of one layer on this rank's heads: softmax scale ``query_pre_attn_scalar ** -0.5``.

    Args (beyond the model's): ``sliding_window``, the layer's window or None;
    ``logit_softcap``, the attention-logit cap or None.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None, *, sliding_window: int | None,
                 logit_softcap: float | None) -> None:
        super().__init__()
        d = config.head_dim
        bias = config.hf_value("attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.total_num_heads, config.total_num_kv_heads,
                                          ctx, bias=bias, dtype=dtype, quantization=quantization)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.total_num_heads * d, config.hidden_size, ctx, bias=bias, dtype=dtype,
                                        quantization=quantization)
        scale = config.hf_value("query_pre_attn_scalar", float(d), (int, float)) ** -0.5
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, scale, sliding_window=sliding_window,
                                   logit_softcap=logit_softcap)

    def normalize_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """The projected ``qkv (T, (H + 2 KVH) d)`` before RoPE: as is (Gemma 3 norms q and k here)."""
        return qkv

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.normalize_qk(self.qkv_proj(x))  # (T, (num_heads + 2 * num_kv_heads) * d)
        q, k, v = rotate_and_cache(qkv, *rope, *kv_cache, attn_metadata.slot_mapping, self.num_heads,
                                   self.num_kv_heads, kv_scales=self.attn.kv_scales)  # q, k rotated; k, v now in the cache
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (T, num_heads * d)
        return self.o_proj(o)  # (T, hidden), all-reduced over ranks


class GemmaMLP(nn.Module):
    """GeGLU: ``down(gelu(gate(x)) * up(x))`` with ``hidden_activation``'s GELU (tanh approximation)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None) -> None:
        super().__init__()
        activation = config.hf_value("hidden_activation", "gelu_pytorch_tanh")
        if activation not in GELU_APPROXIMATIONS:
            raise ValueError(f"hidden_activation={activation!r} is not supported by {config.architecture}; "
                             f"expected one of {sorted(GELU_APPROXIMATIONS)}")
        self.approximate = GELU_APPROXIMATIONS[activation]
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], ctx, bias=False, dtype=dtype,
                                                       quantization=quantization)
        self.down_proj = RowParallelLinear(size, config.hidden_size, ctx, bias=False, dtype=dtype,
                                           quantization=quantization)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, intermediate) each
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)  # (T, hidden), all-reduced


class GemmaDecoderLayer(nn.Module):
    """Four norms: around the attention (input, post-attention) and around the MLP (pre, post)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None, self_attn: nn.Module, layer_type: str) -> None:
        super().__init__()
        size, eps, device = config.hidden_size, config.rms_norm_eps, ctx.device
        self.layer_type = layer_type
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype=dtype, device=device)
        self.self_attn = self_attn
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype=dtype, device=device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype=dtype, device=device)
        self.mlp = GemmaMLP(config, ctx, dtype, quantization)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype=dtype, device=device)

    def forward(self, rope: Rope, h: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        a = self.self_attn(rope, self.input_layernorm(h), kv_cache, attn_metadata)  # (T, hidden)
        h = h + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(h))  # (T, hidden)
        return h + self.post_feedforward_layernorm(m)  # (T, hidden)


class GemmaModel(nn.Module):
    """Scaled embedding, the decoder layers with their layer type's RoPE, final norm.

    ``ropes``: ``(rope_theta, rope_scaling)`` per layer type; one rotary embedding per
    distinct pair, computed once per step.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, layers: list[GemmaDecoderLayer],
                 ropes: dict[str, tuple[float, dict[str, Any] | None]]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx, dtype=dtype)
        # transformers: sqrt(hidden_size) as a tensor cast to the weights' dtype (bfloat16 rounds it).
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5, dtype=dtype, device=ctx.device),
                             persistent=False)
        distinct = sorted({(theta, repr(scaling)): (theta, scaling) for theta, scaling in ropes.values()}.items())
        self.rotary_embs = nn.ModuleList(RotaryEmbedding(config.head_dim, theta, scaling, ctx.device)
                                         for _, (theta, scaling) in distinct)
        keys = [key for key, _ in distinct]
        self.rope_index = {t: keys.index((theta, repr(scaling))) for t, (theta, scaling) in ropes.items()}
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=ctx.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids) * self.normalizer  # (T, hidden), all-reduced over ranks
        ropes = [emb(positions, h.dtype, attn_metadata.rope_seq_lens) for emb in self.rotary_embs]  # (T, 1, d) pairs
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h = layer(ropes[self.rope_index[layer.layer_type]], h, kv_cache, attn_metadata)  # (T, hidden)
        return self.norm(h)  # (T, hidden)


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2: :class:`GemmaModel` and a (tied) vocab-parallel LM head with the final-logit cap.

    Args: those of :class:`~worker.models.base.CausalLM`.

    Raises:
        ValueError: an unsupported ``hidden_activation``, or a family key of the wrong type.
    """

    stacked_params_mapping = LLAMA_STACKED_PARAMS

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, *, tie_word_embeddings: bool,
                 quantization: Quantization | None = None) -> None:
        super().__init__()
        self.config = config
        self.quantization = quantization
        self.final_logit_softcap = config.hf_value("final_logit_softcapping", None, (int, float))
        layer_types = self.layer_types(config)
        layers = [GemmaDecoderLayer(config, ctx, dtype, quantization,
                                    self.attention(config, ctx, dtype, quantization, layer_type), layer_type)
                  for layer_type in layer_types]
        self.model = GemmaModel(config, ctx, dtype, layers, self.ropes(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx, dtype=dtype)
        self.tie_word_embeddings = tie_word_embeddings
        if tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def layer_types(self, config: ModelConfig) -> tuple[str, ...]:
        """Each layer's type: the config's ``layer_types``, else local and global alternating."""
        return gemma_layer_types(config, 2)

    def attention(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                  quantization: Quantization | None, layer_type: str) -> nn.Module:
        """A layer's attention: Gemma 2 soft-caps its logits (``attn_logit_softcapping``)."""
        window = config.sliding_window if layer_type == "sliding_attention" else None
        cap = config.hf_value("attn_logit_softcapping", None, (int, float))
        return Gemma2Attention(config, ctx, dtype, quantization, sliding_window=window, logit_softcap=cap)

    def ropes(self, config: ModelConfig) -> dict[str, tuple[float, dict[str, Any] | None]]:
        """RoPE per layer type: Gemma 2 has one for all."""
        return {layer_type: (config.rope_theta, config.rope_scaling) for layer_type in LAYER_TYPES}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """``input_ids, positions (T,) int64`` -> final hidden states ``(T, hidden_size)``; writes ``kv_caches``."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)  # (T, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden (N, hidden_size)`` -> ``(N, vocab_size)`` on rank 0 (soft-capped), else None. A collective."""
        logits = self.lm_head(hidden)  # (N, vocab_size) on rank 0
        if logits is None or self.final_logit_softcap is None:
            return logits
        cap = self.final_logit_softcap
        return torch.tanh(logits / cap) * cap  # (N, vocab_size)
