"""RMSNorm, LayerNorm and the SwiGLU activation, replicated on every rank (no communication)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.kernels import cpu_kernels_available
from worker.layers.weights import new_parameter


def _compiled(x: torch.Tensor) -> bool:
    """Whether the compiled CPU kernels (worker/kernels/cpu_elementwise.cpp) take ``x``."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and cpu_kernels_available()


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang and Sennrich 2019, arXiv:1910.07467).

    ``y = w * (x / sqrt(mean(x**2) + eps))``, the statistics in float32 and the
    result cast back before scaling, exactly as ``transformers``' ``LlamaRMSNorm``.

    Shapes: ``x (..., hidden_size) -> (..., hidden_size)``, ``x.dtype``: the residual
    stream ``(T, hidden_size)``, or every head ``(T, num_heads, head_dim)`` with
    ``hidden_size = head_dim`` (QK-norm: Qwen3's and Gemma 3's ``q_norm``/``k_norm``,
    fused into the RoPE pass by :func:`worker.layers.rotary.rotate_and_cache`).
    """

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((hidden_size,), dtype, device)
        self.weight.shard_ids = (None,)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _compiled(x) and x.stride(-1) == 1:
            return torch.ops.tpserve_cpu.rms_norm(x, self.weight, self.eps)  # (T, hidden_size), one pass
        input_dtype = x.dtype
        x32 = x.to(torch.float32)  # (T, hidden_size) float32
        variance = x32.pow(2).mean(-1, keepdim=True)  # (T, 1)
        x32 = x32 * torch.rsqrt(variance + self.eps)  # (T, hidden_size)
        return self.weight * x32.to(input_dtype)  # (T, hidden_size)

    def add_and_norm(self, residual: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + x, rms_norm(residual + x))``, both ``(T, hidden_size)``: the residual add fused.

        One pass over the rows on the compiled path (vLLM's ``fused_add_rms_norm``, out of place).
        """
        if _compiled(x) and _compiled(residual) and x.stride(-1) == residual.stride(-1) == 1:
            return torch.ops.tpserve_cpu.add_rms_norm(residual, x, self.weight, self.eps)
        h = residual + x
        return h, self(h)


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm with a zero-centred weight: ``x / sqrt(mean(x**2) + eps) * (1 + w)``, all in float32, then cast back.

    The checkpoint stores ``w`` (0 means identity). ``transformers``' ``Gemma2RMSNorm``, ``Qwen3NextRMSNorm``
    and ``Qwen3_5RMSNorm`` multiply before the cast (Llama's :class:`RMSNorm` casts first).
    Shapes: ``x (..., size) -> (..., size)``, ``x.dtype``.
    """

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((size,), dtype, device)
        self.weight.shard_ids = (None,)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # (..., size)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)  # (..., size)


class LayerNorm(nn.Module):
    """Layer normalisation (Ba et al. 2016, arXiv:1607.06450): ``(x - mean) / sqrt(var + eps) * w (+ b)``.

    The statistics and the affine in float32, the result cast back: ``transformers``'
    ``CohereLayerNorm`` (no bias, ``bias=False``) and, in float32, ``torch.nn.LayerNorm``
    (StarCoder2, with a bias). Shapes: ``x (..., hidden_size) -> (..., hidden_size)``, ``x.dtype``.
    """

    def __init__(self, hidden_size: int, eps: float, *, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((hidden_size,), dtype, device)
        self.weight.shard_ids = (None,)  # type: ignore[attr-defined]
        self.bias = new_parameter((hidden_size,), dtype, device) if bias else None
        if self.bias is not None:
            self.bias.shard_ids = (None,)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        y = F.layer_norm(x.float(), self.weight.shape, self.weight.float(), bias, self.eps)  # (..., hidden_size)
        return y.to(x.dtype)


class Float32ScaledRMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies before the cast back (``transformers``' ``Olmo2RMSNorm``):
    ``(w * (x / sqrt(mean(x**2) + eps))).to(x.dtype)``, all in float32.

    In float32 it is :class:`RMSNorm` (the same numbers, the compiled path); in bfloat16 it
    rounds once instead of twice. Shapes as :class:`RMSNorm`.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)  # (T, hidden_size)
        x32 = x.to(torch.float32)  # (T, hidden_size)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)  # (T, hidden_size)

    def add_and_norm(self, residual: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + x, norm(residual + x))``: the fused pass in float32, else unfused."""
        if x.dtype == torch.float32:
            return super().add_and_norm(residual, x)
        h = residual + x
        return h, self(h)


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer 2020, arXiv:2002.05202): ``silu(gate) * up``.

    Shapes: ``gate_up (T, 2 * n)`` laid out ``[gate | up]`` ``-> (T, n)``.
    """

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if _compiled(gate_up) and gate_up.stride(-1) == 1:
            return torch.ops.tpserve_cpu.silu_and_mul(gate_up)  # (T, n), one pass
        gate, up = gate_up.chunk(2, dim=-1)  # (T, n) each
        return F.silu(gate) * up  # (T, n)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, then a SiLU gate (Gated DeltaNet's output norm; ``transformers``'
    ``Qwen3NextRMSNormGated``, flash-linear-attention's ``FusedRMSNormGated``).

    ``y = (w * (x / sqrt(mean(x**2) + eps)).to(x.dtype)) * silu(z)``: the statistics in float32, the
    normalised value cast back before the weight, the gate in float32, the result cast to ``x.dtype``.
    Shapes: ``x, z (..., size) -> (..., size)``; ``w (size,)`` is replicated on every rank.
    """

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((size,), dtype, device)
        self.weight.shard_ids = (None,)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)  # (..., size)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * x32.to(x.dtype)  # (..., size)
        return (y * F.silu(z.to(torch.float32))).to(x.dtype)  # (..., size)
