"""Gemma 3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``), one tensor-parallel shard of it.

Gemma 2's decoder (worker/models/gemma2.py: ``(1 + w)`` norms four per layer, scaled
embeddings, tanh-GELU GeGLU, ``query_pre_attn_scalar``, final-logit cap) with, as
``transformers``' ``modeling_gemma3.py`` (Gemma Team 2025, arXiv:2503.19786):

    q, k, v = qkv_proj(norm(h))
    q, k = q_norm(q), k_norm(k)                  per head, Gemma's (1 + w) RMSNorm, before RoPE
    local layers:  rope(theta_local)  over a sliding window
    global layers: rope(theta_global, scaled)  over the whole context

* five local layers to one global (``layer_types``; else every ``sliding_window_pattern``-th
  layer, default 6, is global);
* RoPE per layer type: ``rope_parameters`` nested by layer type (``transformers`` 5), or
  the older ``rope_theta`` / ``rope_scaling`` for global layers and ``rope_local_base_freq``
  for local ones;
* no attention-logit soft-cap: ``transformers``' Gemma 3 attention does not apply
  ``attn_logit_softcapping``, so neither do we.

``use_bidirectional_attention`` (the embedding variant) is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.models.gemma2 import Gemma2Attention, Gemma2ForCausalLM, GemmaRMSNorm, gemma_layer_types
from worker.parallel_state import ParallelContext


class Gemma3Attention(Gemma2Attention):
    """Gemma 2's attention with q/k norm: each query and key head normalised before RoPE."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None, *, sliding_window: int | None) -> None:
        super().__init__(config, ctx, dtype, quantization, sliding_window=sliding_window, logit_softcap=None)
        self.head_dim = config.head_dim
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype, device=ctx.device)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype, device=ctx.device)

    def normalize_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv (T, (H + 2 KVH) d)`` -> the same with every q and k head RMS-normalised."""
        num_tokens, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, d))  # (T, H, d)
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, d))  # (T, KVH, d)
        return torch.cat([q.view(num_tokens, -1), k.view(num_tokens, -1), v], dim=-1)  # (T, (H + 2 KVH) d)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text: :class:`~worker.models.gemma2.Gemma2ForCausalLM` with q/k norm and RoPE per layer type.

    Raises:
        ValueError: ``use_bidirectional_attention``, an unsupported ``hidden_activation``,
            or a family key of the wrong type.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, *, tie_word_embeddings: bool,
                 quantization: Quantization | None = None) -> None:
        if config.hf_value("use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (Gemma 3 embeddings) is not supported: "
                             "tpserve serves causal language models")
        super().__init__(config, ctx, dtype, tie_word_embeddings=tie_word_embeddings, quantization=quantization)

    def layer_types(self, config: ModelConfig) -> tuple[str, ...]:
        """The config's ``layer_types``, else every ``sliding_window_pattern``-th layer global (default 6)."""
        return gemma_layer_types(config, config.hf_value("sliding_window_pattern", 6))

    def attention(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                  quantization: Quantization | None, layer_type: str) -> nn.Module:
        window = config.sliding_window if layer_type == "sliding_attention" else None
        return Gemma3Attention(config, ctx, dtype, quantization, sliding_window=window)

    def ropes(self, config: ModelConfig) -> dict[str, tuple[float, dict[str, Any] | None]]:
        """Global layers: the full-attention RoPE; local: their own base, unscaled unless nested says otherwise."""
        if config.layer_rope_parameters:
            return {t: config.layer_rope(t) for t in ("full_attention", "sliding_attention")}
        local_theta = config.hf_value("rope_local_base_freq", 10000.0, (int, float))
        return {"full_attention": (config.rope_theta, config.rope_scaling), "sliding_attention": (local_theta, None)}
