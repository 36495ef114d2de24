"""OLMo 3 (``Olmo3ForCausalLM``): OLMo 2 with three sliding-window layers to one of full attention.

Reference: ``transformers``' ``modeling_olmo3.py``. The layer is OLMo 2's
(worker/models/olmo2.py: post-norms, full-width QK norm); what changes is per layer type:

    layer i:  "sliding_attention" (window sliding_window)  or  "full_attention"
              layer_types; default: every 4th layer full, the others sliding (Olmo3Config)
    RoPE:     each type its own (rope_parameters nested by layer type; an old flat
              rope_scaling applies to the full-attention layers only, as Olmo3Config does)

The step computes one ``(cos, sin)`` per distinct RoPE and each layer takes its type's
(:class:`LayerTypeRopeModel`). Every attention path takes the window (worker/attention.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from worker.attention import AttentionMetadata
from worker.layers.rotary import RotaryEmbedding
from worker.models.base import KVCache
from worker.models.llama import LlamaModel
from worker.models.olmo2 import Olmo2ForCausalLM
from worker.parallel_state import ParallelContext


def olmo3_layer_types(config: ModelConfig) -> tuple[str, ...]:
    """The config's ``layer_types``, else ``Olmo3Config``'s default: every fourth layer full, the rest sliding."""
    if config.hf_config.get("layer_types") is not None:
        return config.layer_types
    return tuple("full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                 for i in range(config.num_hidden_layers))


class LayerTypeRopeModel(LlamaModel):
    """:class:`LlamaModel` whose layers take their layer type's RoPE.

    ``layer_types``: this stage's layers' types, in order; ``ropes``: ``(rope_theta,
    rope_scaling)`` per type. One rotary embedding per distinct pair, each computed once per step.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, layers: list[nn.Module],
                 layer_types: list[str], ropes: dict[str, tuple[float, dict[str, Any] | None]], *,
                 embedding: bool, head: bool) -> None:
        super().__init__(config, ctx, dtype, layers, embedding=embedding, head=head)
        distinct = list({repr(pair): pair for pair in ropes.values()}.items())
        self.rotary_embs = nn.ModuleList(
            RotaryEmbedding(config.head_dim, theta, scaling, ctx.device, max_position=config.max_model_len)
            for _, (theta, scaling) in distinct)
        keys = [key for key, _ in distinct]
        self.rope_of_layer = [keys.index(repr(ropes[t])) for t in layer_types]  # layer -> index in rotary_embs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        # (T, hidden): embedded and all-reduced over ranks, or the previous pipeline stage's output.
        h = self.embed_tokens(input_ids) if hidden_states is None else hidden_states
        ropes = [emb(positions, h.dtype, attn_metadata.rope_seq_lens) for emb in self.rotary_embs]  # (T, 1, d) pairs
        for layer, rope, kv_cache in zip(self.layers, self.rope_of_layer, kv_caches, strict=True):
            h = layer(ropes[rope], h, kv_cache, attn_metadata)  # (T, hidden)
        return h if self.norm is None else self.norm(h)  # (T, hidden)


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3: :class:`~worker.models.olmo2.Olmo2ForCausalLM` with sliding-window layers and RoPE per layer type."""

    def layer_window(self, config: ModelConfig, layer_index: int) -> int | None:
        """``sliding_window`` on the ``"sliding_attention"`` layers, None on the others."""
        return config.sliding_window if olmo3_layer_types(config)[layer_index] == "sliding_attention" else None

    def build_model(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                    layers: list[nn.Module]) -> LlamaModel:
        types = olmo3_layer_types(config)
        ropes = {t: config.layer_rope(t) for t in set(types)}
        if not config.layer_rope_parameters:  # a flat rope_scaling scales the full-attention layers only
            ropes = {t: (config.rope_theta, config.rope_scaling if t == "full_attention" else None) for t in ropes}
        model = LayerTypeRopeModel(config, ctx, dtype, layers, list(types[slice(*self.layer_range)]), ropes,
                                   embedding=self.has_embedding, head=self.has_head)
        return self.final_norm(config, ctx, dtype, model)
