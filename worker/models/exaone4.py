"""EXAONE 4 (``Exaone4ForCausalLM``): local/global layers, per-head QK norm, post-norms, RoPE on local layers only.

Reference: ``transformers``' ``modeling_exaone4.py`` (LG AI Research 2025,
arXiv:2507.11407). Per layer on this rank's heads:

    q, k, v = qkv_proj(h)                                  no input norm, no biases
    q, k = q_norm(q), k_norm(k)                            RMSNorm over head_dim, per head (as Qwen3)
    local  ("sliding_attention"): rope(q), rope(k), attention over sliding_window
    global ("full_attention"):    no RoPE when the model has a sliding_window ("global NoPE",
                                  worker/layers/nope.py); with none, every layer rotates
    h = h + post_attention_layernorm(o_proj(attention))
    h = h + post_feedforward_layernorm(down_proj(silu(gate) * up))

``layer_types``, else ``sliding_window_pattern``: an integer ``p`` makes every ``p``-th
layer global (``Exaone4Config``), a string such as ``"LLLG"`` names each layer's type in
turn. The post-norm layer is worker/layers/post_norm.py's, its norms Llama's RMSNorm
(``Exaone4RMSNorm`` casts before the weight).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata
from worker.layers.nope import MaybeRope, position_and_cache
from worker.layers.norm import RMSNorm
from worker.layers.post_norm import PostNormDecoderLayer
from worker.models.base import KVCache
from worker.models.llama import Biases, LlamaForCausalLM, LlamaMLP
from worker.models.qwen3 import Qwen3Attention
from worker.parallel_state import ParallelContext


class Exaone4Attention(Qwen3Attention):
    """Qwen3's attention (per-head QK norm) that rotates only when ``use_rope``; ``sliding_window`` its window."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 quantization: Quantization | None, *, sliding_window: int | None, use_rope: bool) -> None:
        super().__init__(config, ctx, dtype, quantization, Biases(), sliding_window=sliding_window)
        self.use_rope = use_rope

    def forward(self, rope: MaybeRope, x: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (T, (num_heads + 2 * num_kv_heads) * d)
        q, k, v = position_and_cache(qkv, rope if self.use_rope else None, *kv_cache, attn_metadata.slot_mapping,
                                     self.num_heads, self.num_kv_heads,
                                     qk_norm=(self.q_norm, self.k_norm), kv_scales=self.attn.kv_scales)  # normed, rotated (local), cached
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (T, num_heads * d)
        return self.o_proj(o)  # (T, hidden), all-reduced over ranks


def exaone4_layer_types(config: ModelConfig) -> tuple[str, ...]:
    """``layer_types``, else ``sliding_window_pattern`` (an integer period, or a string of ``L``/``G``)."""
    if config.hf_config.get("layer_types") is not None:
        return config.layer_types
    n = config.num_hidden_layers
    if config.hf_config.get("sliding_window") is None:
        return ("full_attention",) * n
    pattern = config.hf_value("sliding_window_pattern", 4, (int, str))
    if isinstance(pattern, str):
        return tuple("sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(n))
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n))


class Exaone4ForCausalLM(LlamaForCausalLM):
    """EXAONE 4: :class:`Exaone4Attention` and Llama's MLP in a post-norm layer; constructor and errors as Llama's."""

    @classmethod
    def biases(cls, config: ModelConfig) -> Biases:
        """None anywhere (``Exaone4Attention``, ``Exaone4MLP``)."""
        return Biases()

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        local = exaone4_layer_types(config)[layer_index] == "sliding_attention"
        # transformers: rotate when the model has no window at all, or on a local layer.
        use_rope = config.hf_config.get("sliding_window") is None or local
        attention = Exaone4Attention(config, ctx, dtype, quantization, use_rope=use_rope,
                                     sliding_window=config.sliding_window if local else None)
        norm = partial(RMSNorm, config.hidden_size, config.rms_norm_eps, dtype=dtype, device=ctx.device)
        return PostNormDecoderLayer(attention, LlamaMLP(config, ctx, dtype, quantization), norm)
