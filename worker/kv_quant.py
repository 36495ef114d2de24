"""The 8-bit KV cache (``--kv-cache-dtype fp8|int8``): storage types, per-token scales, the key offset.

Each layer's K and V caches hold one byte per element, and beside them a scale per position and KV
head (docs/design/kernels.md, "8-bit KV cache"):

* ``k_scale``, ``v_scale``: ``(num_blocks, num_kv_heads, block_size)`` bfloat16 (a head's scales of a
  block contiguous), one per (token, KV head) row of K and of V, set when the row is written: ``s = bf16(max(max_i |y_i|, SCALE_FLOOR) / qmax)``,
  the row's absmax mapped onto the code range (dynamic, per token and head: TensorRT-LLM's and
  KIVI's granularity for values, arXiv:2402.02750). A row is written once and never rescaled, so a
  block's codes never change after its tokens are written (prefix caching shares them as they are).
* ``k_offset``: ``(num_kv_heads, d)`` float32 per layer, static: keys are stored as ``y = k - k_offset``.
  Keys carry large per-channel offsets (stories260k: a channel's mean up to 8.6x its standard
  deviation), which set a row's absmax while the information lies in the deviations; subtracting the
  channel's mean first leaves the codes the deviations (KIVI's observation that keys are structured per
  channel, taken as a static zero point). It costs the kernels one dot product per query and head:
  ``q . (s * c + mu) = s * (q . c) + q . mu``. It is calibrated once at start-up: the mean key per
  layer, head and channel over one fixed prompt (:data:`CALIBRATION_TOKENS` seeded token ids), so a
  server always uses the same offset and a prefix-cache hit, a preempted and recomputed sequence and
  a moved stream read exactly what a miss would have written. Any offset is exact (it is added back);
  a good one only leaves the codes more resolution.

A reader converts back ``k ~= c * k_scale[block, head, offset] + k_offset[head]``, ``v ~= c * v_scale[..]``
(``block, offset = divmod(slot, block_size)``):

* ``fp8``: float8 e4m3 (``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, finite max
  448), ``c = fp8(clamp(y / s, -448, 448))``, round-to-nearest-even: relative error <= 2^-4.
* ``int8``: ``c = clamp(round(y / s), -127, 127)``, absolute error <= ``s / 2`` = the row's absmax / 254.

The bfloat16 scale is rounded to nearest, so ``|y / s|`` may exceed qmax by a factor up to ``1 + 2^-8``:
the clamp takes it (an int8 code rounds back to 127, an fp8 one loses < 0.4 % of one element).
Per-token scales cost 2 bytes per (token, head) against ``d`` bytes of codes: the pool holds
``2d / (d + 2)`` times a 16-bit cache's blocks (1.78x at d = 16, 1.94x at 64, 1.97x at 128).
Checkpoint ``k_scale`` / ``v_scale`` tensors (vLLM's per-tensor fp8 scheme) are skipped: a per-token
scale is finer than any static one.

The scale pools and the offset are attributes of each layer's :class:`~worker.attention.PagedAttention`
(``kv_scales = (k_scale, v_scale, k_offset)``, set by the runner before any CUDA graph is captured).
"""

from __future__ import annotations

import torch

#: ``--kv-cache-dtype`` -> the cache's storage dtype (None: the activations' dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
#: Largest magnitude each storage dtype holds (int8 kept symmetric: -128 unused).
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
#: The per-token scales' dtype: 2 bytes, float32's exponent range (no underflow), 8 bits of mantissa.
SCALE_DTYPE = torch.bfloat16
#: A row's absmax is floored here, so that an all-zero row gets a positive scale (and codes 0).
SCALE_FLOOR = 2.0**-100
#: The calibration prompt's length in tokens, and the seed of its ids.
CALIBRATION_TOKENS = 128
CALIBRATION_SEED = 0

#: One layer's 8-bit cache state: ``(k_scale, v_scale)`` ``(num_blocks, KVH, block_size)`` bfloat16 and
#: ``k_offset`` ``(KVH, d)`` float32.
KVScales = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The cache's storage dtype for ``--kv-cache-dtype`` with ``dtype`` activations.

    Raises:
        ValueError: an unknown ``kv_cache_dtype``.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}; expected one of {sorted(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or dtype


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds 8-bit codes (to be scaled) rather than activations."""
    return cache.dtype in QMAX


def quantize(x: torch.Tensor, dtype: torch.dtype, offset: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x (..., KVH, d)`` (any float dtype) -> ``(codes (..., KVH, d) dtype, scales (..., KVH) bfloat16)``.

    Each row ``y = x - offset`` (``offset (KVH, d)`` float32, None: 0) gets ``s = bf16(max(absmax(y),
    SCALE_FLOOR) / QMAX[dtype])`` and codes ``clamp(y / s, +-QMAX)``, rounded to nearest even (the
    compiled write, cpu_elementwise.cpp, computes the same bits).
    """
    y = x.float()
    if offset is not None:
        y = y - offset
    qmax = QMAX[dtype]
    scales = (y.abs().amax(-1).clamp_min_(SCALE_FLOOR) / qmax).to(SCALE_DTYPE)  # (..., KVH)
    codes = (y / scales.float().unsqueeze(-1)).clamp_(-qmax, qmax)
    if dtype == torch.int8:
        codes = codes.round_()
    return codes.to(dtype), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
               offset: torch.Tensor | None = None) -> torch.Tensor:
    """Codes ``(..., KVH, d)`` with ``scales (..., KVH)`` -> ``dtype`` values ``codes * scale + offset``
    (``offset (KVH, d)`` float32, None: 0; the inverse of :func:`quantize`, up to its rounding)."""
    x = codes.to(torch.float32).mul_(scales.to(torch.float32).unsqueeze(-1))
    if offset is not None:
        x.add_(offset)
    return x.to(dtype)


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype, offset: torch.Tensor | None = None) -> torch.Tensor:
    """``x (n, KVH, d)`` as an 8-bit cache of ``cache_dtype`` holds it, in ``x``'s dtype (what a later read sees)."""
    codes, scales = quantize(x, cache_dtype, offset)
    return dequantize(codes, scales, x.dtype, offset)


def write_rows(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot_mapping: torch.Tensor, kv_scales: KVScales) -> None:
    """Quantize ``k, v (T, KVH, d)`` and store codes and scales at ``slot_mapping (T,) int64``, in place."""
    k_scale, v_scale, k_offset = kv_scales
    num_kv_heads, d, block_size = k.shape[1], k.shape[2], k_scale.shape[2]
    (kc, ks), (vc, vs) = quantize(k, k_cache.dtype, k_offset), quantize(v, v_cache.dtype)
    # As bytes: index_copy_ has no float8 kernel (the copy moves bytes either way).
    k_cache.view(torch.uint8).view(-1, num_kv_heads, d).index_copy_(0, slot_mapping, kc.view(torch.uint8))
    v_cache.view(torch.uint8).view(-1, num_kv_heads, d).index_copy_(0, slot_mapping, vc.view(torch.uint8))
    blocks, offsets = (slot_mapping // block_size)[:, None], (slot_mapping % block_size)[:, None]  # (T, 1)
    heads = torch.arange(num_kv_heads, device=slot_mapping.device)[None, :]  # (1, KVH)
    k_scale[blocks, heads, offsets] = ks  # (T, KVH) into (num_blocks, KVH, block_size)
    v_scale[blocks, heads, offsets] = vs


def calibration_token_ids(vocab_size: int, num_tokens: int) -> tuple[int, ...]:
    """The calibration prompt: ``num_tokens`` ids drawn uniformly from the vocabulary with a fixed seed."""
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    return tuple(torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist())


def kv_scale_kind(name: str) -> str | None:
    """``"k_scale"`` / ``"v_scale"`` for a checkpoint tensor that is a layer's (static) KV cache scale
    (``self_attn.k_scale``, or older compressed-tensors' ``self_attn.k_proj.output_scale``), else None: the
    loader skips them (per-token scales replace them)."""
    if ".layers." not in name:
        return None
    for kind, legacy in (("k_scale", "k_proj"), ("v_scale", "v_proj")):
        # compressed-tensors wrote them as the projection's output_scale before naming them k_scale / v_scale
        if name.endswith((f".self_attn.{kind}", f".self_attn.{legacy}.output_scale")):
            return kind
    return None


def calibrate(layers: list, run_prompt) -> None:
    """Set each layer's ``k_offset`` to its mean key per head and channel over one calibration prompt.

    Args:
        layers: the model's PagedAttention modules, their scale pools set (:meth:`set_kv_scales`), the
            offset still zero (what the prompt's own writes use; they are never read back).
        run_prompt: runs the calibration prompt through the model (one prefill chunk from position 0,
            which attends over its own keys and values, never over the cache).
    """
    for attn in layers:
        attn.kv_calibration = [torch.zeros_like(attn.k_offset), 0]
    try:
        run_prompt()
        for attn in layers:
            key_sum, count = attn.kv_calibration
            attn.k_offset.copy_(key_sum / max(count, 1))  # in place: a captured graph reads this tensor
    finally:
        for attn in layers:
            attn.kv_calibration = None
