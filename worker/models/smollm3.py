"""SmolLM3 (``SmolLM3ForCausalLM``): Llama with no RoPE on every fourth layer.

Reference: ``transformers``' ``modeling_smollm3.py``. The layer is Llama's pre-norm one
(worker/models/llama.py); per layer ``i``:

    no_rope_layers[i] == 1:  q, k rotated (a RoPE layer: Llama's attention as it is)
    no_rope_layers[i] == 0:  q, k unrotated, k cached as projected (a NoPE layer,
                             worker/layers/nope.py)

``no_rope_layers`` (despite its name, 1 means "uses RoPE"), else every
``no_rope_layer_interval``-th layer (default 4) is NoPE. With ``use_sliding_window``
and a ``sliding_window``, ``layer_types`` defaults to a window on the NoPE layers
(``SmolLM3Config``); the config's ``layer_types`` wins. Biases: ``attention_bias`` on
q/k/v and o_proj, ``mlp_bias`` on the MLP. The LM head is tied by default.

The RoPE layers are Llama's own attention and keep the compiled CPU decode block at
``tp_size > 1``; a NoPE layer runs the modules (and a stack with one runs no compiled
whole-stack decode at tp 1). Every attention kernel serves a NoPE layer unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.quantization import Quantization
from worker.attention import AttentionMetadata
from worker.layers.nope import MaybeRope, position_and_cache
from worker.models.base import KVCache
from worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from worker.parallel_state import ParallelContext


class NoPEAttention(LlamaAttention):
    """Llama attention that ignores the step's RoPE: keys cached and attended unrotated."""

    def forward(self, rope: MaybeRope, x: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (T, (num_heads + 2 * num_kv_heads) * d)
        q, k, v = position_and_cache(qkv, None, *kv_cache, attn_metadata.slot_mapping, self.num_heads,
                                     self.num_kv_heads, kv_scales=self.attn.kv_scales)  # k, v now in the cache, unrotated
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # (T, num_heads * d)
        return self.o_proj(o)  # (T, hidden), all-reduced over ranks


def smollm3_rope_layers(config: ModelConfig) -> tuple[bool, ...]:
    """Per layer, whether it rotates: ``no_rope_layers`` (1: RoPE), else all but every ``no_rope_layer_interval``-th."""
    flags = config.hf_value("no_rope_layers", None, list)
    if flags is not None:
        return tuple(bool(flag) for flag in flags)
    interval = config.hf_value("no_rope_layer_interval", 4)
    return tuple((i + 1) % interval != 0 for i in range(config.num_hidden_layers))


def smollm3_layer_windows(config: ModelConfig) -> tuple[int | None, ...]:
    """Per layer, its sliding window or None: ``layer_types``, else a window on the NoPE layers (``SmolLM3Config``)."""
    window = config.sliding_window  # None unless use_sliding_window (tpserve/model_config.py)
    if config.hf_config.get("layer_types") is not None:
        return tuple(config.layer_sliding_window(i) for i in range(config.num_hidden_layers))
    return tuple(None if rotates else window for rotates in smollm3_rope_layers(config))


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: Llama whose NoPE layers take :class:`NoPEAttention`; constructor and errors as Llama's."""

    def decoder_layer(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                      quantization: Quantization | None, layer_index: int) -> nn.Module:
        biases = self.biases(config)
        window = smollm3_layer_windows(config)[layer_index]
        attention_class = LlamaAttention if smollm3_rope_layers(config)[layer_index] else NoPEAttention
        attention = attention_class(config, ctx, dtype, quantization, biases, sliding_window=window)
        return LlamaDecoderLayer(config, ctx, dtype, attention, LlamaMLP(config, ctx, dtype, quantization, bias=biases.mlp))
