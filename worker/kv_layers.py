"""The attention layers an 8-bit KV cache's scale pools attach to (``--kv-cache-dtype fp8|int8``).

A model's per-head attention layers are :class:`~worker.attention.PagedAttention` modules (scale pools
``(num_blocks, num_kv_heads, block_size)`` and a calibrated key offset, worker/kv_quant.py); multi-head
latent attention's are the :class:`~worker.layers.mla_attention.LatentPagedAttention` of each
:class:`~worker.layers.mla.MultiHeadLatentAttention` (pools ``(num_blocks, 1, block_size)`` for the latent
and the rotated key, no offset). Both take ``set_kv_scales(first, second)`` and keep ``kv_scales`` whose first
two entries are the pools, in the cache layout's layer order.
"""

from __future__ import annotations

from torch import nn

from worker.attention import PagedAttention
from worker.layers.mla import MultiHeadLatentAttention
from worker.layers.mla_attention import LatentPagedAttention


def eight_bit_layers(model: nn.Module) -> tuple[list[PagedAttention], list[LatentPagedAttention]]:
    """``model``'s per-head attention layers and its latent attention layers, each in layer order."""
    modules = list(model.modules())
    return ([m for m in modules if isinstance(m, PagedAttention)],
            [m.attn for m in modules if isinstance(m, MultiHeadLatentAttention)])
