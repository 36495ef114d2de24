"""Rotary position embedding (RoPE; Su et al. 2021, arXiv:2104.09864).

The inverse frequencies follow Hugging Face ``transformers`` exactly
(``transformers/modeling_rope_utils.py``, v5):

* default: ``inv_freq[i] = 1 / theta ** (2i / d)`` for ``i < d/2``
  (``LlamaRotaryEmbedding.compute_default_rope_parameters``);
* ``"linear"`` (position interpolation, Chen et al. 2023, arXiv:2306.15595):
  ``inv_freq / factor`` (``_compute_linear_scaling_rope_parameters``);
* ``"llama3"``: wavelengths ``2 pi / inv_freq`` longer than
  ``original_max_position_embeddings / low_freq_factor`` are divided by
  ``factor``, shorter than ``... / high_freq_factor`` kept, and those in between
  interpolated with ``smooth = (old_len / wavelen - low) / (high - low)``
  (``_compute_llama3_parameters``);
* ``"yarn"`` (Peng et al. 2023, arXiv:2309.00071): dimensions that turn fewer than
  ``beta_slow`` times over ``original_max_position_embeddings`` are interpolated
  (``/ factor``), those turning more than ``beta_fast`` times kept, a linear ramp
  between; ``cos`` and ``sin`` are multiplied by ``attention_factor`` (default
  ``0.1 ln(factor) + 1``, or the ``mscale`` / ``mscale_all_dim`` ratio)
  (``_compute_yarn_parameters``);
* ``"dynamic"`` (dynamic NTK): the base grows with the sequence length ``L``,
  ``theta' = theta * (factor * L / max_position_embeddings - (factor - 1)) ** (d / (d - 2))``
  for ``L > max_position_embeddings`` (``_compute_dynamic_ntk_parameters``).
  ``transformers`` recomputes it per forward from the largest position in the batch,
  and its cache keeps each key rotated as it was when computed: for one sequence, the
  prompt's tokens with ``L`` = the prompt's length and each generated token at
  position ``p`` with ``L = p + 1``. Here every token gets
  ``L = max(prompt length, p + 1)`` of its own sequence (``AttentionMetadata.rope_seq_lens``),
  which is that, token for token, for every sequence of a batch; a batched
  ``transformers`` forward instead uses the batch's longest length for all its rows
  (docs/design/models.md, "RoPE scaling").

The rotation is the "rotate half" (GPT-NeoX) layout Llama checkpoints use:
``x * cos + rotate_half(x) * sin`` with ``cos, sin`` of ``cat(freqs, freqs)``,
computed in float32 and cast to the activations' dtype, as ``transformers`` does.
Cohere rotates interleaved pairs ``(x[2i], x[2i+1])`` instead (``modeling_cohere.py``'s
``rotate_half`` and ``repeat_interleave`` of the angles; GPT-J's layout, vLLM's
``is_neox_style=False``): :class:`RotaryEmbedding` with ``interleaved=True`` and
:func:`apply_rotary_interleaved`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from worker.attention import write_kv_cache
from worker.kernels import cpu_kernels_available
from worker.layers.norm import RMSNorm


def rope_inv_freq(head_size: int, theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``(head_size / 2,)`` float32, in radians per position.

    For ``"dynamic"`` these are the frequencies up to ``max_position_embeddings``
    (the plain ones); longer sequences get :func:`dynamic_inv_freq`.

    Raises:
        ValueError: an unsupported ``rope_scaling["rope_type"]``.
    """
    exponent = torch.arange(0, head_size, 2, dtype=torch.int64).to(torch.float) / head_size  # (d/2,)
    inv_freq = 1.0 / (theta**exponent)  # (d/2,)
    rope_type = "default" if rope_scaling is None else rope_scaling["rope_type"]
    if rope_type in ("default", "dynamic"):
        return inv_freq
    factor = rope_scaling["factor"]
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "yarn":
        return _yarn_inv_freq(head_size, theta, rope_scaling)
    if rope_type != "llama3":
        raise ValueError(f"rope_type={rope_type!r} is not supported")
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # (d/2,) positions per turn
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)  # (d/2,)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)  # (d/2,)


def _yarn_inv_freq(head_size: int, theta: float, rope_scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's ``(d/2,)`` float32 inverse frequencies: interpolated below the ramp, kept above it."""
    factor = rope_scaling["factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]

    def correction_dim(num_rotations: float) -> float:  # the dimension that turns num_rotations times
        return head_size * math.log(old_context_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(rope_scaling["beta_fast"]), correction_dim(rope_scaling["beta_slow"])
    if rope_scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001  # as transformers does: no zero-width ramp
    ramp = ((torch.arange(head_size // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # (d/2,)
    pos_freqs = theta ** (torch.arange(0, head_size, 2).to(torch.float) / head_size)  # (d/2,)
    extrapolation = 1 - ramp  # 1: keep the dimension's frequency, 0: divide it by factor
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_scaling(rope_scaling: dict[str, Any] | None) -> float:
    """The factor ``cos`` and ``sin`` are multiplied by: YaRN's ``attention_factor``, else 1."""
    if rope_scaling is None or rope_scaling["rope_type"] != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = rope_scaling["factor"], rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def dynamic_inv_freq(head_size: int, theta: float, rope_scaling: dict[str, Any],
                     seq_lens: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK: ``(T, d/2)`` float32 inverse frequencies for sequence lengths ``seq_lens (T,) int64``.

    Lengths up to ``max_position_embeddings`` give the plain frequencies. The arithmetic
    is ``transformers``' (float32 tensors from an int64 length), element by element.
    """
    max_len = rope_scaling["max_position_embeddings"]
    factor = rope_scaling["factor"]
    base = theta * ((factor * seq_lens / max_len) - (factor - 1)) ** (head_size / (head_size - 2))  # (T,) float32
    exponent = torch.arange(0, head_size, 2, dtype=torch.int64, device=seq_lens.device).to(torch.float) / head_size
    scaled = 1.0 / (base[:, None] ** exponent[None, :])  # (T, d/2)
    plain = 1.0 / (theta**exponent)  # (d/2,) what transformers keeps up to max_position_embeddings
    return torch.where(seq_lens[:, None] > max_len, scaled, plain[None, :])  # (T, d/2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # (..., d/2) each
    return torch.cat((-x2, x1), dim=-1)  # (..., d)


class RotaryEmbedding(nn.Module):
    """Cosines and sines of the rotation angles ``position * inv_freq``, once per step.

    The values are ``transformers``' ``LlamaRotaryEmbedding.forward``'s (float32 angles,
    times YaRN's attention factor, then cast), and every layer shares the step's
    ``(cos, sin)``. Given ``max_position``, they are computed once for positions
    ``0 .. max_position - 1`` (on first use, per dtype) and a step gathers its rows, as
    vLLM's rotary embedding keeps its ``cos_sin_cache``: one ``index_select`` each instead of
    the step's seven elementwise ops (64 rows: ~30 -> ~10 us). Computed per step instead off
    the CPU, for dynamic NTK (the angles depend on the sequence's length), without
    ``max_position``, or where the two tables would pass ``MAX_TABLE_BYTES``.

    Args:
        head_size: size of one head ``d`` (even).
        theta: base wavelength (``rope_theta``).
        rope_scaling: ``None`` or the dict of :class:`tpserve.model_config.ModelConfig`.
        device: where ``inv_freq`` (and the tables) live.
        max_position: positions the tables cover (the model's longest context); None: no tables.
        interleaved: ``cos, sin`` laid out ``[f0, f0, f1, f1, ...]`` for :func:`apply_rotary_interleaved`
            (Cohere) instead of ``[f0, f1, ..., f0, f1, ...]``.
    """

    #: Largest pair of cos/sin tables kept (bytes, float32): 32K positions of 128 dimensions.
    MAX_TABLE_BYTES = 32 << 20

    def __init__(self, head_size: int, theta: float, rope_scaling: dict[str, Any] | None, device: torch.device,
                 max_position: int | None = None, *, interleaved: bool = False) -> None:
        super().__init__()
        self.interleaved = interleaved
        inv_freq = rope_inv_freq(head_size, theta, rope_scaling).to(device)  # (d/2,) float32
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.head_size, self.theta, self.rope_scaling = head_size, theta, rope_scaling
        self.dynamic = rope_scaling is not None and rope_scaling["rope_type"] == "dynamic"
        self.attention_scaling = rope_attention_scaling(rope_scaling)
        fits = max_position is not None and 2 * 4 * max_position * head_size <= self.MAX_TABLE_BYTES
        # The CPU only: there a step's small ops are its cost (a GPU's decode replays a graph), and a position
        # past the table raises an IndexError there, not a device-side assert.
        self.max_position = max_position if fits and not self.dynamic and device.type == "cpu" else None
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # dtype -> cos, sin (P, 1, d)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions (T,) int64`` -> ``cos, sin`` each ``(T, 1, d)`` in ``dtype`` (broadcast over heads).

        ``seq_lens (T,) int64``: dynamic NTK only, the sequence length each row's rotation is
        computed for (``AttentionMetadata.rope_seq_lens``); None: ``positions + 1``.
        A position past the tables (a draft model with a shorter context than its target's) is computed.
        """
        if self.max_position is None:
            return self._compute(positions, dtype, seq_lens)
        tables = self._tables.get(dtype)
        if tables is None:
            positions_all = torch.arange(self.max_position, device=self.inv_freq.device)  # (P,)
            tables = self._tables[dtype] = self._compute(positions_all, dtype, None)  # (P, 1, d) each
        try:
            return tables[0].index_select(0, positions), tables[1].index_select(0, positions)  # (T, 1, d) each
        except IndexError:
            return self._compute(positions, dtype, seq_lens)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype,
                 seq_lens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`'s values from the angles: ``cos, sin`` each ``(T, 1, d)`` in ``dtype``."""
        if self.dynamic:
            lengths = positions + 1 if seq_lens is None else seq_lens  # (T,)
            inv_freq = dynamic_inv_freq(self.head_size, self.theta, self.rope_scaling, lengths)  # (T, d/2)
            freqs = positions[:, None].float() * inv_freq  # (T, d/2) radians
        else:
            freqs = positions[:, None].float() * self.inv_freq[None, :]  # (T, d/2) radians
        if self.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)  # (T, d): each angle on its pair (2i, 2i + 1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # (T, d)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)  # (T, 1, d) each


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (T, num_heads, d)`` by the step's ``cos, sin (T, 1, d)``: ``x cos + rotate_half(x) sin``."""
    return x * cos + _rotate_half(x) * sin  # (T, num_heads, d)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved pairs of ``x (T, num_heads, d)`` by ``cos, sin (T, 1, d)`` of an interleaved
    :class:`RotaryEmbedding`: ``y[2i] = x[2i] cos - x[2i+1] sin``, ``y[2i+1] = x[2i+1] cos + x[2i] sin``
    (``transformers``' ``modeling_cohere.py``)."""
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)  # (T, num_heads, d)
    return x * cos + rotated * sin  # (T, num_heads, d)


def rotate_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate the query and key heads of ``qkv`` and write this step's keys and values into the cache.

    Args:
        qkv: ``(T, (num_heads + 2 * num_kv_heads) * d)``, the fused projection's output
            (queries, keys, values); rotated in place on the compiled path.
        cos, sin: the step's ``(T, 1, d)`` from :class:`RotaryEmbedding`, in ``qkv``'s dtype or float32
            (then the rotation runs in float32 and is cast back, as ``transformers``' OLMo 2/3 do).
        k_cache, v_cache: one layer's ``(num_blocks, block_size, num_kv_heads, d)``.
        slot_mapping: ``(T,) int64`` cache slot of each row.
        qk_norm: ``(q_norm, k_norm)``, RMSNorms of size ``d`` applied to every query and
            key head before the rotation (QK-norm, as Qwen3 and Gemma 3 do); None: none.
        kv_scales: the layer's ``(k_scale, v_scale, k_offset)`` (``PagedAttention.kv_scales``): an
            8-bit cache's scale pools, written with the codes, and key offset (worker/kv_quant.py);
            unused with a float cache.

    Returns:
        ``q (T, num_heads, d)``, ``k (T, num_kv_heads, d)`` rotated, and ``v (T, num_kv_heads, d)``.

    On a float32 CPU step with the compiled kernels this is one pass over the rows
    (worker/kernels/cpu_elementwise.cpp, the same roundings as :func:`apply_rotary`; into an
    8-bit cache the same codes as :func:`worker.kv_quant.quantize`);
    elsewhere the norms, :func:`apply_rotary` on the q and k heads together and
    :func:`worker.attention.write_kv_cache`.
    """
    num_tokens, d = qkv.shape[0], k_cache.shape[-1]
    if (qkv.device.type == "cpu" and qkv.dtype == cos.dtype == torch.float32
            and (k_cache.dtype == torch.float32 or kv_scales is not None)
            and qkv.is_contiguous() and cpu_kernels_available()):
        # An 8-bit cache: the op stores the codes (kv_scales is None for a float cache: no scales passed).
        scales: tuple[torch.Tensor, ...] = () if k_cache.dtype == torch.float32 or kv_scales is None else kv_scales
        if qk_norm is None:
            torch.ops.tpserve_cpu.rotary_and_cache(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                                                   num_kv_heads, *scales)
        else:
            q_norm, k_norm = qk_norm
            torch.ops.tpserve_cpu.qk_norm_rotary_and_cache(qkv, q_norm.weight, k_norm.weight, q_norm.eps, cos, sin,
                                                           k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                                                           *scales)
        # split_with_sizes: the C method (Tensor.split is a Python wrapper around it, a few us a layer).
        q, k, v = qkv.view(num_tokens, -1, d).split_with_sizes([num_heads, num_kv_heads, num_kv_heads], dim=1)
        return q, k, v
    qk_size = (num_heads + num_kv_heads) * d
    qk = qkv[:, :qk_size].view(num_tokens, -1, d)  # (T, num_heads + num_kv_heads, d)
    if qk_norm is not None:
        q_norm, k_norm = qk_norm
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        qk = torch.cat([q_norm(q), k_norm(k)], dim=1)  # (T, num_heads + num_kv_heads, d), each head normalised
    # q and k heads rotated together: one set of elementwise ops instead of two.
    qk = apply_rotary(qk, cos, sin)  # (T, num_heads + num_kv_heads, d)
    if qk.dtype != qkv.dtype:  # float32 cos/sin on bfloat16 heads (OLMo 2/3): rotated in float32, rounded once
        qk = qk.to(qkv.dtype)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    v = qkv[:, qk_size:].view(num_tokens, num_kv_heads, d)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    return q, k, v
