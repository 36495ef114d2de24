"""The 8-bit KV cache (``--kv-cache-dtype fp8|int8``): storage types, per-layer scales, calibration.

Each layer's K and V caches hold one byte per element, ``q = quantize(x / s)``, with static
scales ``s`` of shape ``(num_kv_heads, head_dim)`` float32 per layer for K and for V: one per
channel of each of this rank's KV heads, the same for every position, so the cache holds the
codes alone (twice the blocks of a 16-bit cache, exactly) and a reader converts back
``x ~= q * s[head, channel]``. Per-channel, not per-tensor: keys have outlier channels (KIVI,
Liu et al. 2024, arXiv:2402.02750, quantizes keys per channel for that reason), and one scale for
all of them leaves the small channels a few int8 steps; on stories260k's goldens, free-running
greedy, a calibrated int8 scale per tensor kept 28 % of the tokens, per channel 85 % (99 %
teacher-forced; docs/design/kernels.md, "8-bit KV cache"). A per-channel scale costs the
kernels nothing: the key's folds into the query (``q . (c * s) = (q * s) . c``), the value's
into the output.

* ``fp8``: float8 e4m3 (``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, finite max
  448), ``q = fp8(clamp(x / s, -448, 448))``, round-to-nearest-even. Relative error <= 2^-4
  for ``|x / s|`` in the normal range ``[2^-6, 448]``: its error is relative, whatever the scale.
* ``int8``: ``q = clamp(round(x / s), -127, 127)``, absolute error <= ``s / 2``.

Where the scales come from (docs/design/kernels.md, "8-bit KV cache"):

1. the checkpoint: ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` scalar tensors (vLLM's
   and llm-compressor's names for a per-tensor ``kv_cache_scheme``), used as they are (every
   channel the same scale);
2. otherwise a start-up calibration (``ModelRunner``'s first ``init_kv_cache``): each rank runs
   one fixed prompt (:data:`CALIBRATION_TOKENS` seeded token ids) and sets
   ``s = CALIBRATION_MARGIN * max_t |x_t| / qmax`` per layer, head and channel from the keys and
   values that prompt computed (no channel below ``1 / CHANNEL_FLOOR`` of its layer's largest
   scale, so that a channel the prompt left near zero does not saturate on another prompt).
   The same server therefore always uses the same scales, so a prefix-cache hit, a preempted and
   recomputed sequence and a moved stream read exactly what a miss would have written. Values
   beyond the calibrated range saturate (the margin leaves them room).

The scales are attributes of each layer's :class:`~worker.attention.PagedAttention`
(``k_scale``, ``v_scale``: tensors on the device, set before any CUDA graph is captured and
never replaced). The compiled CPU kernel and the Triton kernel convert the bytes in registers
and multiply the query by ``k_scale`` and the output by ``v_scale``; the torch path dequantizes
the blocks it already gathers into a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

#: ``--kv-cache-dtype`` -> the cache's storage dtype (None: the activations' dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
#: Largest magnitude each storage dtype holds (int8 kept symmetric: -128 unused).
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
#: The calibration prompt's length in tokens, and the seed of its ids.
CALIBRATION_TOKENS = 128
CALIBRATION_SEED = 0
#: Headroom over the calibration prompt's largest value, so that other prompts' larger keys and
#: values rarely saturate (int8 pays it in resolution: 1.5x coarser steps).
CALIBRATION_MARGIN = 1.5
#: No calibrated channel scale is below its layer's largest over this.
CHANNEL_FLOOR = 32.0


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


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x (..., KVH, d)`` (any float dtype) -> ``dtype`` codes of ``x / scale``, saturated at ``+-QMAX[dtype]``.

    ``scale``: ``(KVH, d)`` float32 (broadcast over the leading dimensions).
    """
    qmax = QMAX[dtype]
    y = (x.float() / scale).clamp_(-qmax, qmax)
    if dtype == torch.int8:
        y = y.round_()
    return y.to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes ``q (..., KVH, d)`` -> ``dtype`` values ``q * scale`` (``scale (KVH, d)``; the inverse of
    :func:`quantize`, up to its rounding)."""
    return q.to(torch.float32).mul_(scale).to(dtype)


def scale_for(absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Calibrated scales ``(KVH, d)`` float32 for values up to ``absmax (KVH, d)``:
    ``CALIBRATION_MARGIN * absmax / QMAX``, floored at the largest over :data:`CHANNEL_FLOOR` (all 1.0 for zeros)."""
    scale = CALIBRATION_MARGIN * absmax.float() / QMAX[dtype]
    top = float(scale.max())
    if top <= 0:
        return torch.ones_like(scale)
    return scale.clamp_min(top / CHANNEL_FLOOR)


def checkpoint_kv_scales(model_dir: str | Path) -> dict[int, tuple[float, float]]:
    """The checkpoint's per-layer ``(k_scale, v_scale)`` by layer index; empty when it has none.

    Read from the safetensors files' ``model.layers.{i}.self_attn.{k,v}_scale`` scalars (how vLLM
    and llm-compressor store an fp8 ``kv_cache_scheme``).

    Raises:
        ValueError: a scale that is not a positive finite number, or a layer with only one of the two.
    """
    from safetensors import safe_open

    found: dict[int, dict[str, float]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                kind = kv_scale_kind(name)
                if kind is None:
                    continue
                value = float(f.get_tensor(name).float().reshape(-1)[0])
                if not (value > 0 and value < float("inf")):
                    raise ValueError(f"checkpoint KV cache scale {name}={value} must be a positive finite number")
                found.setdefault(int(name.split(".layers.")[1].split(".")[0]), {})[kind] = value
    for layer, scales in found.items():
        if len(scales) != 2:
            raise ValueError(f"checkpoint has {sorted(scales)} but not both k_scale and v_scale for layer {layer}")
    return {layer: (s["k_scale"], s["v_scale"]) for layer, s in found.items()}


def kv_scale_kind(name: str) -> str | None:
    """``"k_scale"`` / ``"v_scale"`` for a checkpoint tensor that is a layer's KV cache scale, else None."""
    if ".layers." not in name:
        return None
    for kind in ("k_scale", "v_scale"):
        if name.endswith(f".self_attn.{kind}"):
            return kind
    return None


def calibration_token_ids(vocab_size: int, num_tokens: int) -> tuple[int, ...]:
    """The calibration prompt: ``num_tokens`` ids drawn uniformly from the vocabulary with a fixed seed."""
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    return tuple(torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist())


def set_checkpoint_scales(layers: list, scales: dict[int, tuple[float, float]], layer_indices: Sequence[int],
                          device: torch.device) -> None:
    """Give each of ``layers`` (this stage's attention layers, model layers ``layer_indices``: a hybrid's
    state layers have none) its checkpoint scales, every channel the layer's one scale.

    Raises:
        ValueError: the checkpoint has scales for some layers but not one of ``layer_indices``.
    """
    for index, attn in zip(layer_indices, layers, strict=True):
        if index not in scales:
            raise ValueError(f"the checkpoint has KV cache scales for layers {sorted(scales)} but not layer {index}")
        attn.set_kv_scales(*(torch.full((attn.num_kv_heads, attn.head_size), s, dtype=torch.float32, device=device)
                             for s in scales[index]))


def calibrate(layers: list, run_prompt, dtype: torch.dtype, device: torch.device) -> None:
    """Set each layer's ``k_scale``, ``v_scale`` from the keys and values of one calibration prompt.

    Args:
        layers: the model's PagedAttention modules.
        run_prompt: runs the calibration prompt through the model (one prefill chunk from position 0,
            which attends over its own keys and values, never over the not yet scaled cache).
        dtype: the cache's storage dtype (int8 or float8_e4m3fn).
        device: the cache's.
    """
    for attn in layers:
        ones = torch.ones(attn.num_kv_heads, attn.head_size, device=device)
        attn.set_kv_scales(ones, ones)  # what the prompt's own writes use (never read back)
        attn.kv_absmax = [torch.zeros_like(ones)] * 2
    try:
        run_prompt()
        for attn in layers:
            attn.set_kv_scales(*(scale_for(m, dtype) for m in attn.kv_absmax))
    finally:
        for attn in layers:
            attn.kv_absmax = None
