"""Multi-head latent attention (MLA): DeepSeek V2/V3, Kimi K2; one layer, on this rank's heads.

DeepSeek-V2 (arXiv:2405.04434, section 2.1), as ``transformers``' ``DeepseekV3Attention``
computes it, for a flat batch of ``T`` tokens ``x (T, hidden)``:

    q            = q_b_proj(rms_norm(q_a_proj(x)))   with q_lora_rank (low-rank query), else q_proj(x)
    q_nope, q_pe = split(q per head, [d_n, d_r])      d_n = qk_nope_head_dim, d_r = qk_rope_head_dim
    c, k_pe      = split(kv_a_proj_with_mqa(x), [r, d_r])   r = kv_lora_rank: ONE latent per token
    c            = rms_norm(c)                        kv_a_layernorm
    q_pe, k_pe   = rope(q_pe), rope(k_pe)             decoupled RoPE: only these dimensions turn;
                                                      k_pe is one key shared by every head
    cache[slot]  = (c, k_pe)                          r + d_r numbers per token (576 for V3)
    k_nope, v    = split(kv_b_proj(c) per head, [d_n, d_v])
    o            = o_proj(softmax(scale * [q_nope ; q_pe] . [k_nope ; k_pe]) v)

``scale = (d_n + d_r) ** -0.5``, multiplied by ``mscale**2`` where the RoPE scaling has an
``mscale_all_dim`` (YaRN's ``0.1 * mscale_all_dim * ln(factor) + 1``; ``transformers``'
``yarn_apply_mscale``): the whole query-key product is rescaled, not only the rotary part
that YaRN's ``attention_factor`` (``mscale / mscale_all_dim``) scales through ``cos, sin``.

``rope_interleave`` (DeepseekV3Config's default, True): the checkpoint's rotary dimensions
are laid out as interleaved pairs ``(x0, x1), (x2, x3)...``, each rotated by one frequency,
and ``transformers`` returns them de-interleaved (evens' rotation first, then odds'). So the
rotary part is de-interleaved here first, then rotated in the usual "rotate half" layout
(worker/layers/rotary.py): the same numbers, and queries and cached keys agree on the layout.

Tensor parallelism: ``q_proj``/``q_b_proj`` and ``kv_b_proj`` are column-parallel by head,
``o_proj`` row-parallel (one all-reduce); ``q_a_proj``, ``kv_a_proj_with_mqa`` and both norms
are replicated, so every rank computes and caches the whole latent (the cache is not split).
Prefill attends in the expanded form, decode in the weight-absorbed form
(worker/layers/mla_attention.py).
"""

from __future__ import annotations

import math

from typing import cast

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.rope_config import rope_dict
from worker.attention import AttentionMetadata
from worker.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from worker.layers.mla_attention import LatentPagedAttention, write_latent_cache
from worker.layers.norm import RMSNorm
from worker.layers.rotary import apply_rotary
from worker.parallel_state import ParallelContext

#: ``DeepseekV3RMSNorm``'s default epsilon, which ``q_a_layernorm`` and ``kv_a_layernorm`` keep
#: (``transformers`` builds them without ``rms_norm_eps``).
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(qk_head_dim: int, raw_rope: dict | None) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale**2`` where the RoPE dict has ``mscale_all_dim`` (module docstring).

    Args:
        qk_head_dim: ``qk_nope_head_dim + qk_rope_head_dim``.
        raw_rope: config.json's ``rope_parameters`` / ``rope_scaling`` dict as written, or None.
    """
    scale = qk_head_dim**-0.5
    rope = raw_rope or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    mscale_all_dim = rope.get("mscale_all_dim")
    if rope_type != "default" and mscale_all_dim:
        factor = float(rope["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``(..., d)`` laid out ``x0, x1, x2, x3...`` -> ``x0, x2, ..., x1, x3, ...`` (evens, then odds)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MultiHeadLatentAttention(nn.Module):
    """One layer's MLA on this rank's heads: ``forward(rope, x, kv_cache, meta) -> (T, hidden)`` (all-reduced).

    Config keys (DeepseekV3Config's defaults): ``q_lora_rank`` (1536; null: a full-rank
    ``q_proj``), ``kv_lora_rank`` (512), ``qk_nope_head_dim`` (128), ``qk_rope_head_dim`` (64),
    ``v_head_dim`` (128), ``rope_interleave`` (True), ``attention_bias`` (False: on
    ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` when True).

    ``kv_cache``: ``(latent_cache (num_blocks, block_size, 1, r), rope_cache (num_blocks,
    block_size, 1, d_r))``, 8-bit codes with ``attn.kv_scales`` under ``--kv-cache-dtype int8|fp8``
    (worker/layers/mla_attention.py); ``rope``: the step's ``cos, sin (T, 1, d_r)``.

    Raises:
        ValueError: a config value of the wrong type (named); ``num_attention_heads`` not
            divisible by the tensor-parallel size.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.total_num_heads
        self.q_lora_rank = config.hf_value("q_lora_rank", None, int)
        self.kv_lora_rank = config.hf_value("kv_lora_rank", 512)
        self.d_n = config.hf_value("qk_nope_head_dim", 128)
        self.d_r = config.hf_value("qk_rope_head_dim", 64)
        self.d_v = config.hf_value("v_head_dim", 128)
        self.rope_interleave = config.hf_value("rope_interleave", True)
        bias = config.hf_value("attention_bias", False)
        qk_head_dim = self.d_n + self.d_r
        device = ctx.device
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_head_dim, ctx, bias=False, dtype=dtype)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, ctx, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, dtype=dtype, device=device)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_head_dim, ctx, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.d_r, ctx, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype, device=device)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.d_n + self.d_v), ctx, bias=False,
                                              dtype=dtype)
        self.o_proj = RowParallelLinear(heads * self.d_v, hidden, ctx, bias=bias, dtype=dtype)
        self.num_heads = heads // ctx.tp_size  # this rank's (the column-parallel layers checked the split)
        raw_rope = rope_dict(config.hf_config)
        self.attn = LatentPagedAttention(self.d_n, mla_softmax_scale(qk_head_dim, raw_rope))

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)  # (T, H * (d_n + d_r))
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # (T, H * (d_n + d_r))
        q_nope, q_pe = q.view(num_tokens, self.num_heads, -1).split([self.d_n, self.d_r], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.d_r], dim=-1)  # (T, r), (T, d_r)
        latent = self.kv_a_layernorm(latent.contiguous())  # (T, r)
        if self.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        cos, sin = rope  # (T, 1, d_r) each
        q_pe = apply_rotary(q_pe, cos, sin)  # (T, H, d_r)
        k_pe = apply_rotary(k_pe.unsqueeze(1), cos, sin).squeeze(1)  # (T, d_r)
        latent_cache, rope_cache = kv_cache
        write_latent_cache(latent, k_pe, latent_cache, rope_cache, attn_metadata.slot_mapping, self.attn.kv_scales)
        kv_b = cast(torch.Tensor, self.kv_b_proj.weight)  # float: MLA refuses --quantization (its absorbed form)
        o = self.attn(q_nope, q_pe, latent, k_pe, kv_b, latent_cache, rope_cache, attn_metadata)  # (T, H * d_v)
        return self.o_proj(o)  # (T, hidden), all-reduced over ranks
