"""The post-norm decoder layer: each sublayer's output normalised before the residual add (OLMo 2/3, EXAONE 4).

Llama normalises a sublayer's input (``h + attn(norm(h))``). OLMo 2 (OLMo et al. 2024,
arXiv:2501.00656, section 3.2 "reordered norm"; ``transformers``' ``Olmo2DecoderLayer``)
and EXAONE 4 (``Exaone4DecoderLayer``) normalise its output instead, and have no input norm:

    h = h + post_attention_layernorm(self_attn(h))
    h = h + post_feedforward_layernorm(mlp(h))

The residual stream itself is never normalised inside the stack, only by the model's
final norm. Gemma 2/3 have both norms (worker/models/gemma2.py's ``GemmaDecoderLayer``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from worker.attention import AttentionMetadata

#: One layer's paged cache ``(k_cache, v_cache)`` (worker/models/base.py's ``KVCache``).
KVCache = tuple[torch.Tensor, torch.Tensor]


class PostNormDecoderLayer(nn.Module):
    """``self_attn`` and ``mlp`` with a norm on each one's output, given (a family picks them).

    Args:
        self_attn: ``(rope, x (T, hidden), kv_cache, attn_metadata) -> (T, hidden)``, all-reduced.
        mlp: ``x (T, hidden) -> (T, hidden)``, all-reduced.
        make_norm: builds one ``(T, hidden) -> (T, hidden)`` norm (OLMo's float32-scaled RMSNorm, EXAONE's Llama one).
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, make_norm: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.post_attention_layernorm = make_norm()
        self.mlp = mlp
        self.post_feedforward_layernorm = make_norm()

    def forward(self, rope: object, h: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        a = self.self_attn(rope, h, kv_cache, attn_metadata)  # (T, hidden)
        h = h + self.post_attention_layernorm(a)  # (T, hidden)
        return h + self.post_feedforward_layernorm(self.mlp(h))  # (T, hidden)
