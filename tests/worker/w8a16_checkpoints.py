"""8-bit weight-only checkpoints (GPTQ ``bits: 8``, compressed-tensors W8A16) for the w8a16 tests.

Each writer returns ``(checkpoint, dequantized)``: the model in the format's exact on-disk layout,
and the float checkpoint ``transformers`` runs as the reference, whose linear weights are the
FORMAT'S REFERENCE DEQUANTIZATION of the stored tensors (written here, independently of
worker/layers/int4_formats.py), asserted equal to the quantization's own definition ``s * (q - z)``:

* :func:`save_gptq8`: GPTQ as AutoGPTQ / GPTQModel pack 8 bits (:func:`pack_bytes`, the packer the
  format defines: byte ``i`` of an int32, bits ``8i .. 8i + 7``, holds element ``4j + i`` of its
  four): ``qweight (K / 4, N)`` int32 packed along K, ``qzeros (groups, N / 4)`` packed along N
  (``checkpoint_format: gptq`` stores ``z - 1``, ``gptq_v2`` stores ``z``), ``scales (groups, N)``
  float16, ``g_idx (K,)`` int32 (act-order: a random column order, as in int4_checkpoints.py).
  Reference (:func:`gptq8_reference_dequantize`): AutoGPTQ's ``QuantLinear`` unpacking with
  ``bits = 8``: shift by ``[0, 8, 16, 24]``, mask ``0xFF``, ``zeros + 1`` masked for v1,
  ``scales[g_idx] * (w - zeros[g_idx])``; itself checked against a per-element loop over the words
  (:func:`unpack_bytes_loop`) in tests/worker/test_w8a16_loader.py.
  v1 cannot store ``z = 0`` (AutoGPTQ packs ``z - 1 = -1`` unmasked, flooding the word); the
  writer asserts every ``z >= 1`` there.
* :func:`save_compressed_tensors_w8a16`: quantized, packed and decompressed by the
  ``compressed-tensors`` library (``pack-quantized``, ``num_bits: 8``; int8_checkpoints.py's
  writer with ``num_bits=8``).

Quantization: symmetric ``s = max|w| / 127``, ``z = 128``, ``q = clamp(round(w / s) + 128, 0, 255)``;
asymmetric ``s = (max - min) / 255`` (the range widened to include 0), ``z = clamp(round(-min / s), 0, 255)``,
``q = clamp(round(w / s) + z, 0, 255)``; per output row and group of ``G`` input columns (``G = K``: -1).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tests.worker.int4_checkpoints import column_order, definition, save_compressed_tensors_w4a16
from tests.worker.int8_checkpoints import LINEAR_WEIGHT, _tensors, _write


def quantize_groups8(w: torch.Tensor, group: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w (N, K)`` -> ``(q (N, K) int64 in [0, 255], s (N, groups) float32 rounded to float16, z (N, groups))``."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    if symmetric:
        s = (wg.abs().amax(dim=2) / 127).half().float()
        z = torch.full_like(s, 128.0)
    else:
        lo, hi = wg.amin(dim=2).clamp(max=0), wg.amax(dim=2).clamp(min=0)
        s = ((hi - lo) / 255).half().float()
        z = torch.round(-lo / s).clamp(0, 255)
    q = (torch.round(wg / s[:, :, None]) + z[:, :, None]).clamp(0, 255).long().reshape(n, k)
    return q, s, z


def pack_bytes(values: torch.Tensor) -> torch.Tensor:
    """``(R, C)`` codes in ``[0, 255]`` -> ``(R, C / 4)`` int32, byte ``i`` of word ``j`` holding element ``4j + i``."""
    r, c = values.shape
    v = values.long().reshape(r, c // 4, 4)
    word = torch.zeros(r, c // 4, dtype=torch.long)
    for i in range(4):
        word |= (v[:, :, i] & 0xFF) << (8 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the same 32 bits, signed


def unpack_bytes_loop(packed: torch.Tensor) -> torch.Tensor:
    """An independent inverse of :func:`pack_bytes`, one element at a time: ``(R, W)`` int32 -> ``(R, 4 W)``."""
    rows, words = packed.shape
    out = torch.zeros(rows, 4 * words, dtype=torch.long)
    for r in range(rows):
        for j in range(words):
            word = int(packed[r, j]) % 2**32  # the unsigned 32 bits
            for i in range(4):
                out[r, 4 * j + i] = (word // 256**i) % 256
    return out


def gptq8_reference_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                               g_idx: torch.Tensor, v1: bool) -> torch.Tensor:
    """AutoGPTQ's QuantLinear at ``bits = 8``: returns the float weight ``(N, K)``."""
    shifts = torch.arange(0, 32, 8, dtype=torch.int32)
    zeros = (qzeros.unsqueeze(2) >> shifts[None, None, :]) & 0xFF  # (groups, N / 4, 4)
    if v1:
        zeros = (zeros + 1) & 0xFF
    zeros = zeros.reshape(scales.shape)  # (groups, N)
    weight = (qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xFF  # (K / 4, 4, N)
    weight = weight.reshape(-1, weight.shape[2])  # (K, N)
    w = scales.float()[g_idx.long()] * (weight.float() - zeros.float()[g_idx.long()])  # (K, N)
    return w.t()


def save_gptq8(source: Path, target: Path, dequantized_target: Path, *, group: int, sym: bool,
               desc_act: bool = False, checkpoint_format: str = "gptq", seed: int = 0,
               pattern: re.Pattern[str] = LINEAR_WEIGHT, act_order: re.Pattern[str] | None = None
               ) -> tuple[Path, Path]:
    """``source`` as an 8-bit GPTQ checkpoint (module docstring), and its dequantized float copy; the linear
    weights named by ``pattern`` are quantized (a MoE's per-expert modules with tests' MOE_LINEAR_WEIGHT).
    With ``desc_act``, the weights named by ``act_order`` (None: all) get a random column order, the others
    ``g_idx = k // G``; a layer's inputs shared by q/k/v, gate/up (Mixtral's w1/w3) share theirs."""
    tensors, out, dequantized = _tensors(source), {}, {}
    generator = torch.Generator().manual_seed(seed)
    perms: dict[str, torch.Tensor] = {}  # one act order per input: q/k/v share theirs, gate/up theirs
    v1 = checkpoint_format == "gptq"
    for name, w in tensors.items():
        if not pattern.match(name):
            out[name] = dequantized[name] = w
            continue
        n, k = w.shape
        g = k if group == -1 else group
        perm = column_order(perms, name, k, desc_act, act_order, generator)
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[perm] = torch.arange(k) // g
        q_perm, s, z = quantize_groups8(w[:, perm], g, sym)
        q = torch.empty_like(q_perm)
        q[:, perm] = q_perm
        if v1:
            assert bool((z >= 1).all()), f"{name}: a zero point 0 is not storable in GPTQ v1"
        prefix = name.removesuffix(".weight")
        out[f"{prefix}.qweight"] = pack_bytes(q).t().contiguous()  # (K / 4, N): word [r, n] holds rows 4r..4r+3
        out[f"{prefix}.qzeros"] = pack_bytes(z.t().long() - (1 if v1 else 0))  # (groups, N / 4)
        out[f"{prefix}.scales"] = s.t().to(torch.float16).contiguous()  # (groups, N)
        out[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        reference = gptq8_reference_dequantize(out[f"{prefix}.qweight"], out[f"{prefix}.qzeros"],
                                               out[f"{prefix}.scales"], out[f"{prefix}.g_idx"], v1)
        exact = definition(q, s, z, g_idx)
        assert torch.equal(reference, exact), name
        dequantized[name] = exact
    config = {"quant_method": "gptq", "bits": 8, "group_size": group, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": checkpoint_format, "damp_percent": 0.01, "true_sequential": True}
    return (_write(source, target, out, lambda c: c.update(quantization_config=config)),
            _write(source, dequantized_target, dequantized, lambda c: None))


def save_compressed_tensors_w8a16(source: Path, target: Path, dequantized_target: Path, *, strategy: str,
                                  symmetric: bool, group: int | None = None,
                                  pattern: re.Pattern[str] = LINEAR_WEIGHT) -> tuple[Path, Path]:
    """``source`` as a compressed-tensors ``pack-quantized`` W8A16 checkpoint written by the library (the weights
    named by ``pattern``)."""
    return save_compressed_tensors_w4a16(source, target, dequantized_target, strategy=strategy,
                                         symmetric=symmetric, group=group, num_bits=8, pattern=pattern)
