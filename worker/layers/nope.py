"""NoPE layers: attention layers that skip the rotary embedding but still cache their keys.

Several families leave RoPE out of some layers and rely on the causal mask for position
("NoPE", Kazemnejad et al. 2023, arXiv:2305.19466): SmolLM3 on every fourth layer
(``no_rope_layers``; ``transformers``' ``modeling_smollm3.py``), EXAONE 4 on its global
layers (``modeling_exaone4.py``: "global NoPE for hybrid attention"), Llama 4 on every
fourth. Such a layer's keys go into the paged cache as projected (after QK-norm, where
the family has one), and its queries attend with them unrotated; nothing else about the
layer changes, so every attention path (the compiled CPU kernel, SDPA, Triton, CUDA
graphs) serves it as it is: the kernels read keys from the cache and never rotate.

:func:`position_and_cache` is the one entry point: given the step's RoPE it rotates
(worker/layers/rotary.py's ``rotate_and_cache``), given None it does not.
"""

from __future__ import annotations

import torch

from worker.attention import write_kv_cache
from worker.kv_quant import KVScales
from worker.layers.norm import RMSNorm
from worker.layers.rotary import rotate_and_cache

#: The step's RoPE ``(cos, sin)``, each ``(T, 1, head_dim)``; None: a NoPE layer.
MaybeRope = tuple[torch.Tensor, torch.Tensor] | None


def position_and_cache(
    qkv: torch.Tensor,
    rope: MaybeRope,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
    kv_scales: KVScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split ``qkv``, rotate q and k by ``rope`` (none when None), write k and v into the cache.

    Args:
        qkv: ``(T, (num_heads + 2 * num_kv_heads) * d)``, the fused projection's output.
        rope: the step's ``(cos, sin)``, or None for a NoPE layer.
        k_cache, v_cache: one layer's ``(num_blocks, block_size, num_kv_heads, d)``.
        slot_mapping: ``(T,) int64`` cache slot of each row.
        qk_norm: per-head ``(q_norm, k_norm)`` RMSNorms of size ``d`` (EXAONE 4, Qwen3), or None.
        kv_scales: the layer's ``(k_scale, v_scale, k_offset)`` for an 8-bit cache (``PagedAttention.kv_scales``),
            or None (a cache in the activations' dtype; the callers that pass none keep that).

    Returns:
        ``q (T, num_heads, d)``, ``k (T, num_kv_heads, d)`` (rotated unless NoPE) and ``v (T, num_kv_heads, d)``.
    """
    if rope is not None:
        return rotate_and_cache(qkv, *rope, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, qk_norm,
                                kv_scales=kv_scales)
    num_tokens, d = qkv.shape[0], k_cache.shape[-1]
    q, k, v = qkv.view(num_tokens, -1, d).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    if qk_norm is not None:
        q, k = qk_norm[0](q), qk_norm[1](k)  # (T, H, d), (T, KVH, d): each head normalised
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    return q, k, v
