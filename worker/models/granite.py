"""IBM Granite 3 (dense): the Llama decoder with four scalar multipliers.

Reference: ``transformers``' ``modeling_granite.py`` (``GraniteConfig``). For a flat batch
of ``T`` tokens on one rank, the Llama layout (worker/models/llama.py) with:

    h = embed(input_ids) * embedding_multiplier
    for each layer:
        h = h + residual_multiplier * o_proj(attention(rope(q, k), v))   softmax scale attention_multiplier
                 where q, k, v = qkv_proj(rms_norm(h))                    (not head_dim ** -0.5)
        h = h + residual_multiplier * down_proj(silu(gate) * up)
    h = rms_norm(h)
    logits = lm_head(h) / logits_scaling

Biases as Llama (``attention_bias`` on q/k/v and o_proj, ``mlp_bias``). Every multiplier
defaults to 1 (``GraniteConfig``); their values are checked at start-up
(tpserve/model_config_rules.py: each a finite number > 0).
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata, PagedAttention
from worker.models.base import KVCache
from worker.models.llama import Biases, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, Rope
from worker.parallel_state import ParallelContext


class GraniteAttention(LlamaAttention):
    """Llama attention whose softmax scale is ``attention_multiplier`` (default 1)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None, biases: Biases, *, sliding_window: int | None = None) -> None:
        super().__init__(config, ctx, dtype, quantization, biases, sliding_window=sliding_window)
        scale = config.hf_value("attention_multiplier", 1.0, float)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, config.head_dim, scale=scale,
                                   sliding_window=sliding_window)


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with each sub-block's output scaled by ``residual_multiplier`` before its add."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, self_attn: nn.Module,
                 mlp: nn.Module) -> None:
        super().__init__(config, ctx, dtype, self_attn, mlp)
        self.residual_multiplier = config.hf_value("residual_multiplier", 1.0, float)
        self.decode_block = False  # the compiled decode layer adds the residual unscaled

    def forward(self, rope: Rope, h: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        a = self.self_attn(rope, self.input_layernorm(h), kv_cache, attn_metadata)  # (T, hidden)
        h, x = self.post_attention_layernorm.add_and_norm(h, a * self.residual_multiplier)
        return h + self.mlp(x) * self.residual_multiplier  # (T, hidden)


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3: :class:`LlamaForCausalLM` with the embedding, residual, attention and logit multipliers.

    Args and pipeline stages: those of :class:`LlamaForCausalLM`.

    Raises:
        ValueError: ``hidden_act`` is not ``"silu"``, or a multiplier or bias key of the wrong type.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, *, tie_word_embeddings: bool,
                 quantization: Quantization | None = None) -> None:
        super().__init__(config, ctx, dtype, tie_word_embeddings=tie_word_embeddings, quantization=quantization)
        self.embedding_multiplier = config.hf_value("embedding_multiplier", 1.0, float)
        self.logits_scaling = config.hf_value("logits_scaling", 1.0, float)

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        biases = self.biases(config)
        attention = GraniteAttention(config, ctx, dtype, quantization, biases,
                                     sliding_window=config.layer_sliding_window(layer_index))
        mlp = LlamaMLP(config, ctx, dtype, quantization, bias=biases.mlp)
        return GraniteDecoderLayer(config, ctx, dtype, attention, mlp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`LlamaForCausalLM.forward`; the first stage scales its embedding by ``embedding_multiplier``."""
        if hidden_states is None:
            embed = self.model.embed_tokens
            assert embed is not None  # the first stage holds the embedding
            hidden_states = embed(input_ids) * self.embedding_multiplier  # (T, hidden), all-reduced over ranks
        return self.model(input_ids, positions, kv_caches, attn_metadata, hidden_states)  # (T, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden (N, hidden_size)`` -> ``lm_head(hidden) / logits_scaling`` ``(N, vocab_size)`` on rank 0."""
        logits = super().compute_logits(hidden)  # (N, vocab_size) on rank 0, else None
        return None if logits is None else logits / self.logits_scaling
