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

Every attention path serves it: the QK norm runs before the cache write, so the CPU
kernel, SDPA and Triton read normalised keys from the cache; the extra all-reduce is the
ranks' ordinary one (captured by CUDA graphs as o_proj's is). The compiled CPU decode
block is Llama's layer only (not this layer's order of norms), so decode runs the modules.
Pipeline stages: as Llama.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata
from worker.layers.nope import MaybeRope, position_and_cache
from worker.layers.norm import Float32ScaledRMSNorm
from worker.layers.post_norm import PostNormDecoderLayer
from worker.layers.qk_norm import FullWidthRMSNorm, full_width_qk_norm
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
                                     self.num_kv_heads)  # q, k rotated; k, v now in the cache
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (T, num_heads * d)
        return self.o_proj(o)  # (T, hidden), all-reduced over ranks


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2: :class:`Olmo2Attention` and Llama's MLP in a post-norm layer; constructor and errors as Llama's."""

    @classmethod
    def biases(cls, config: ModelConfig) -> Biases:
        """``attention_bias`` on q/k/v and o_proj (default False); never on the MLP."""
        attention_bias = config.hf_value("attention_bias", False)
        return Biases(qkv=attention_bias, o_proj=attention_bias)

    def build_model(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                    layers: list[nn.Module]) -> LlamaModel:
        return self.final_norm(config, ctx, dtype, super().build_model(config, ctx, dtype, layers))

    @staticmethod
    def final_norm(config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, model: LlamaModel) -> LlamaModel:
        """``model`` with its final norm (on the last stage) rounding as the layers' norms do."""
        if model.norm is not None:
            model.norm = Float32ScaledRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=ctx.device)
        return model

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        attention = Olmo2Attention(config, ctx, dtype, quantization, self.biases(config),
                                   sliding_window=self.layer_window(config, layer_index))
        norm = partial(Float32ScaledRMSNorm, config.hidden_size, config.rms_norm_eps, dtype=dtype, device=ctx.device)
        return PostNormDecoderLayer(attention, LlamaMLP(config, ctx, dtype, quantization), norm)

    def layer_window(self, config: ModelConfig, layer_index: int) -> int | None:
        """Layer ``layer_index``'s sliding window: OLMo 2 has none (OLMo 3 overrides)."""
        return None
