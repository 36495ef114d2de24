"""Full-width QK norm: one RMSNorm over all query heads together, one over all key heads (OLMo 2/3, MiniMax-M2).

Qwen3 and Gemma 3 normalise each head on its own (an RMSNorm of size ``head_dim``,
fused into the RoPE pass: worker/layers/rotary.py). OLMo 2 (OLMo et al. 2024,
arXiv:2501.00656; reference: ``transformers``' ``modeling_olmo2.py``, ``Olmo2Attention``)
normalises the whole projection instead, before it is split into heads:

    q = q_norm(q_proj(x))      RMSNorm over num_attention_heads * head_dim
    k = k_norm(k_proj(x))      RMSNorm over num_key_value_heads * head_dim

At tensor parallelism rank ``r`` holds only its heads' columns, so the mean of squares
spans ranks. Each rank sums the squares of its q columns and of its k columns (float32,
``(T, 2)``), one all-reduce adds the ranks' sums, and each rank scales its columns by
its slice of the norm weight. The alternative, gathering every rank's q and k,
moves ``T * (H + KVH) * d`` numbers per rank where this moves ``2 T``; both are one
collective per layer, so the all-reduce is the cheaper. Key/value heads replicated over
ranks (``tp_size > num_key_value_heads``) are counted once per replica in the sum; the
divisor counts them as often (``tp_size * local width``), so the mean is the model's.

Rounding: statistics in float32; the weight multiplied in float32, then the cast back
(``Olmo2RMSNorm``), or ``cast_before_weight`` as ``LlamaRMSNorm`` (MiniMax-M2:
``modeling_minimax_m2.py``'s ``MiniMaxM2RMSNorm`` casts, then multiplies). In float32 the two are
the same numbers.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.layers.weights import CheckpointSource, check_shape, copy_into, new_parameter, read_narrow
from worker.parallel_state import ParallelContext


class FullWidthRMSNorm(nn.Module):
    """This rank's slice ``[start, start + size)`` of an RMSNorm weight over ``total_size`` columns.

    The checkpoint holds the whole ``(total_size,)`` weight (``self_attn.q_norm.weight``);
    the loader reads only this rank's slice. The statistics are computed across ranks by
    :func:`full_width_qk_norm`.
    """

    def __init__(self, total_size: int, start: int, size: int, eps: float, *, dtype: torch.dtype,
                 device: torch.device, cast_before_weight: bool = False) -> None:
        super().__init__()
        self.total_size, self.start, self.size, self.eps = total_size, start, size, eps
        self.cast_before_weight = cast_before_weight
        self.weight = new_parameter((size,), dtype, device, loader=self.load_weight)
        self.weight.shard_ids = (None,)  # type: ignore[attr-defined]

    def load_weight(self, param: nn.Parameter, source: CheckpointSource, shard_id: object = None) -> None:
        """Copy this rank's columns of the ``(total_size,)`` checkpoint weight into ``param``.

        Raises:
            ValueError: the checkpoint weight is not ``(total_size,)``.
        """
        check_shape(source, (self.total_size,))
        copy_into(param.data, read_narrow(source, 0, self.start, self.size))


def full_width_qk_norm(qkv: torch.Tensor, q_norm: FullWidthRMSNorm, k_norm: FullWidthRMSNorm,
                       ctx: ParallelContext) -> torch.Tensor:
    """``qkv (T, q_size + 2 * kv_size)`` -> the same with its q and k columns RMS-normalised over all ranks' heads.

    ``q_size = q_norm.size`` and ``kv_size = k_norm.size`` are this rank's widths; v is
    returned as is. A collective at ``tp_size > 1``: every rank calls it with the same ``T``.
    """
    q_size, kv_size = q_norm.size, k_norm.size
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q32, k32 = q.float(), k.float()  # (T, q_size), (T, kv_size)
    sums = torch.stack([q32.pow(2).sum(-1), k32.pow(2).sum(-1)], dim=-1)  # (T, 2) float32
    sums = ctx.all_reduce(sums)  # every rank's heads: the sums over the full widths (replicas counted each)
    # Python scalars, not tensors built here: no host-to-device copy inside a captured CUDA graph.
    q_inv_rms = torch.rsqrt(sums[:, :1] / (q_size * ctx.tp_size) + q_norm.eps)  # (T, 1)
    k_inv_rms = torch.rsqrt(sums[:, 1:] / (kv_size * ctx.tp_size) + k_norm.eps)  # (T, 1)
    q, k = _scaled(q_norm, q32 * q_inv_rms, qkv.dtype), _scaled(k_norm, k32 * k_inv_rms, qkv.dtype)
    return torch.cat([q, k, v], dim=-1)  # (T, q_size + 2 * kv_size)


def _scaled(norm: FullWidthRMSNorm, normalized: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``normalized (T, size)`` float32 times the weight, in ``dtype``, rounded as the family's norm rounds."""
    if norm.cast_before_weight:
        return norm.weight * normalized.to(dtype)  # LlamaRMSNorm: cast, then weight
    return (norm.weight.float() * normalized).to(dtype)  # Olmo2RMSNorm: weight in float32, then cast
