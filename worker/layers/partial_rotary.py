"""Partial and interleaved RoPE: rotate the first ``rotary_dim`` dimensions of each head, in half or pair layout.

GLM-4.5 (``partial_rotary_factor``, default 0.5) and MiniMax-M2 (``rotary_dim``) rotate a
head's leading ``r = rotary_dim`` dimensions and pass the other ``d - r`` through, as
``transformers``' ``apply_rotary_pos_emb`` of modeling_glm4_moe.py / modeling_minimax_m2.py:

    x[..., :r] = x[..., :r] * cos + rotate_half(x[..., :r]) * sin     rotate_half within the r dims:
                                                                    dimension i pairs with i + r / 2
    x[..., r:] unchanged

with ``cos, sin (T, 1, r)`` from :class:`worker.layers.rotary.RotaryEmbedding` built for
``head_size = r`` (``inv_freq = theta ** (-2i / r)``: the frequencies ``transformers`` derives
from ``int(head_dim * partial_rotary_factor)``). The cache holds whole heads, rotated part
and pass-through part, so every attention path (the CPU kernel, SDPA, the Triton paged
kernel, CUDA graphs) reads it as any other cache: the rotation is the only difference.

Interleaved RoPE (Ernie 4.5, ``transformers``' modeling_ernie4_5_moe.py; the original RoFormer
layout) pairs dimension ``2i`` with ``2i + 1`` (frequency ``i``) instead of ``i`` with ``i + r / 2``:

    x = x * cos' + rotate_pairs(x) * sin'        rotate_pairs(x)[2i] = -x[2i + 1], [2i + 1] = x[2i]
                                                 cos'[2i] = cos'[2i + 1] = cos[i]  (the table's first half)

computed in float32 and rounded once to the activation dtype, as that reference does.
"""

from __future__ import annotations

import torch

from worker.attention import write_kv_cache
from worker.kv_quant import KVScales
from worker.layers.norm import RMSNorm
from worker.layers.rotary import apply_rotary


def rotate_partial_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    rotary_dim: int,
    qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
    interleaved: bool = False,
    kv_scales: KVScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`worker.layers.rotary.rotate_and_cache` rotating the first ``rotary_dim`` dims of each head only,
    in the half layout or (``interleaved``) the pair layout.

    Args:
        qkv: ``(T, (num_heads + 2 * num_kv_heads) * d)``, the fused projection's output.
        cos, sin: the step's ``(T, 1, rotary_dim)``.
        k_cache, v_cache: one layer's ``(num_blocks, block_size, num_kv_heads, d)``.
        slot_mapping: ``(T,) int64`` cache slot of each row.
        rotary_dim: ``r``, even, ``<= d``.
        qk_norm: per-head RMSNorms of size ``d`` applied to q and k before the rotation, or None.
        interleaved: rotate pairs ``(2i, 2i + 1)`` (see the module docstring).
        kv_scales: the layer's ``(k_scale, v_scale, k_offset)`` for an 8-bit cache (``PagedAttention.kv_scales``),
            or None for a cache in the activations' dtype.

    Returns:
        ``q (T, num_heads, d)``, ``k (T, num_kv_heads, d)`` (leading ``r`` dims rotated) and
        ``v (T, num_kv_heads, d)``; k and v written into the cache at their slots.
    """
    num_tokens, d = qkv.shape[0], k_cache.shape[-1]
    qk_size = (num_heads + num_kv_heads) * d
    qk = qkv[:, :qk_size].reshape(num_tokens, num_heads + num_kv_heads, d)  # (T, H + KVH, d)
    if qk_norm is not None:
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        qk = torch.cat([qk_norm[0](q), qk_norm[1](k)], dim=1)  # each head normalised over all d dims
    part = qk[..., :rotary_dim]  # (T, H + KVH, r), q and k heads together
    rotated = apply_interleaved_rotary(part, cos, sin) if interleaved else apply_rotary(part, cos, sin)
    qk = torch.cat([rotated, qk[..., rotary_dim:]], dim=-1) if rotary_dim < d else rotated  # (T, H + KVH, d)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    v = qkv[:, qk_size:].view(num_tokens, num_kv_heads, d)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    return q, k, v


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs ``(2i, 2i + 1)`` of ``x (T, heads, r)`` by the step's ``cos, sin (T, 1, r)`` (half layout).

    In float32, rounded once to ``x.dtype`` (``transformers``' Ernie 4.5).
    """
    half = cos.shape[-1] // 2
    cos = cos[..., :half].float().repeat_interleave(2, dim=-1)  # (T, 1, r): cos of frequency i at 2i and 2i + 1
    sin = sin[..., :half].float().repeat_interleave(2, dim=-1)
    x32 = x.float()
    pairs = torch.stack((-x32[..., 1::2], x32[..., 0::2]), dim=-1).flatten(-2)  # (T, heads, r)
    return (x32 * cos + pairs * sin).to(x.dtype)  # (T, heads, r)
