"""Reading a published 4- or 8-bit checkpoint's tensors into one common form, checked.

Each format (tpserve/quantization_int4.py) stores a linear layer as packed int32 tensors;
:func:`unpack_layer` turns one layer's (or one fused part's) tensors into an
:class:`Int4Tensor`: ``codes (N, K)`` uint8 in ``[0, 2**bits - 1]``, ``scales (N, groups)`` and
``zeros (N, groups)`` float32, ``g_idx (K,)`` int64 (the group of each input column), with

    w[n, k] = scales[n, g_idx[k]] * (codes[n, k] - zeros[n, g_idx[k]])

the format's reference dequantization in every case:

* GPTQ (AutoGPTQ's ``QuantLinear`` / transformers' optimum path): ``qweight (K / 8, N)``
  int32, nibble ``i`` of ``qweight[r, n]`` (bits ``4i .. 4i + 3``) is the code of column
  ``8r + i``; ``qzeros (groups, N / 8)`` int32, nibble ``i`` of ``qzeros[g, c]`` the zero of
  row ``8c + i``, stored minus one under ``checkpoint_format: gptq``; ``scales (groups, N)``;
  ``g_idx (K,)`` int32 (act-order; without ``desc_act`` it is ``k // group_size`` or absent).
* AWQ GEMM (AutoAWQ's ``WQLinear_GEMM``): ``qweight (K, N / 8)`` int32 packed along N in
  AWQ's order: nibble ``i`` of ``qweight[k, c]`` is column ``8c + AWQ_ORDER[i]``; ``qzeros
  (groups, N / 8)`` likewise; ``scales (groups, N)``.
* compressed-tensors ``pack-quantized``: ``weight_packed (N, K / 8)`` int32, nibble ``i`` of
  ``[n, c]`` the signed value of column ``8c + i`` plus 8 (the library's ``pack_to_int32``);
  ``weight_scale (N, groups)``; ``weight_zero_point (N / 8, groups)`` int32 packed along the
  rows the same way (asymmetric only; symmetric: zero 8, the offset); ``weight_shape = [N, K]``;
  with ``actorder: group`` (older llm-compressor GPTQ) ``weight_g_idx (K,)`` int32, as GPTQ's ``g_idx``.

8-bit GPTQ and compressed-tensors (``bits`` / ``num_bits`` 8) pack the same way with four byte
codes an int32 instead of eight nibbles (byte ``i`` is bits ``8i .. 8i + 7``): GPTQ ``qweight
(K / 4, N)``, ``qzeros (groups, N / 4)`` (minus one under ``checkpoint_format: gptq``);
compressed-tensors ``weight_packed (N, K / 4)`` holding the signed value plus 128 (the library's
``pack_to_int32`` at ``num_bits`` 8) and ``weight_zero_point (N / 4, groups)``, symmetric zero 128.

A corrupt layer is refused with a ``ValueError`` naming the tensor: a wrong shape or dtype,
a NaN, infinite or zero scale, a group size that does not divide ``K``, a missing ``g_idx``
with ``desc_act``, a ``g_idx`` out of range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpserve.quantization_int4 import Int4Format

#: AWQ's packing order: nibble i of an int32 holds column AWQ_ORDER[i] of its 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

#: Checkpoint tensor suffix -> part name, per format.
PARTS = {
    "gptq": {"qweight": "qweight", "qzeros": "qzeros", "scales": "scales", "g_idx": "g_idx"},
    "awq": {"qweight": "qweight", "qzeros": "qzeros", "scales": "scales"},
    "compressed-tensors": {"weight_packed": "qweight", "weight_zero_point": "qzeros", "weight_scale": "scales",
                           "weight_shape": "shape", "weight_g_idx": "g_idx"},
}


def required_parts(fmt: Int4Format) -> set[str]:
    """The parts a layer of ``fmt`` must store (names of :data:`PARTS`' values)."""
    if fmt.method == "gptq":
        return {"qweight", "qzeros", "scales"} | ({"g_idx"} if fmt.desc_act else set())
    if fmt.method == "awq":
        return {"qweight", "qzeros", "scales"}
    return ({"qweight", "scales", "shape"} | (set() if fmt.symmetric else {"qzeros"})
            | ({"g_idx"} if fmt.desc_act else set()))


@dataclass
class Int4Tensor:
    """One linear weight ``(N, K)`` in common form (module docstring)."""

    codes: torch.Tensor   # (N, K) uint8 in [0, 15] (4-bit) or [0, 255] (8-bit)
    scales: torch.Tensor  # (N, groups) float32
    zeros: torch.Tensor   # (N, groups) float32
    g_idx: torch.Tensor   # (K,) int64

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def act_order(self) -> bool:
        """Whether ``g_idx`` is not the plain ``k // group_size`` (GPTQ ``desc_act``)."""
        plain = torch.arange(self.codes.shape[1]) // self.group_size
        return not torch.equal(self.g_idx, plain)

    def scale_offset(self) -> torch.Tensor:
        """``(N, groups, 2)`` float32 ``(s, o)`` pairs of the kernel's layout, ``o = -s * z`` (worker/layers/int4_matmul.py)."""
        return torch.stack([self.scales, -self.scales * self.zeros], dim=2)

    def dequantize(self) -> torch.Tensor:
        """``(N, K)`` float32 weights (the formula of the module docstring)."""
        s = self.scales[:, self.g_idx]  # (N, K)
        return s * (self.codes.float() - self.zeros[:, self.g_idx])


def _nibbles(packed: torch.Tensor, dim: int, bits: int = 4) -> torch.Tensor:
    """int32 ``packed`` -> uint8 codes with each int32's ``32 / bits`` codes (low bits first) spread along ``dim``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)  # (32 / bits,)
    mask = (1 << bits) - 1
    if dim == 0:
        codes = (packed.unsqueeze(1) >> shifts[None, :, None]) & mask  # (R, 32 / bits, C)
        return codes.reshape(-1, packed.shape[1]).to(torch.uint8)
    codes = (packed.unsqueeze(2) >> shifts) & mask  # (R, C, 32 / bits)
    return codes.reshape(packed.shape[0], -1).to(torch.uint8)


def _check(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {list(tensor.shape)}, expected {list(shape)}")
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {tensor.dtype}, expected {' or '.join(map(str, dtypes))}")


def _check_scales(name: str, scales: torch.Tensor) -> torch.Tensor:
    scales = scales.float()
    bad = ~torch.isfinite(scales) | (scales == 0)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise ValueError(f"{name} holds {int(bad.sum())} zero or non-finite scales (first at {where}: "
                         f"{float(scales[tuple(where)])}): a corrupt checkpoint")
    return scales


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INT32 = (torch.int32,)


def unpack_layer(fmt: Int4Format, parts: dict[str, torch.Tensor], names: dict[str, str],
                 shape: tuple[int, int]) -> Int4Tensor:
    """One layer's checkpoint tensors -> :class:`Int4Tensor` of the float weight's ``shape (N, K)``.

    Args:
        fmt: the checkpoint's format.
        parts: part name (:data:`PARTS`' values) -> tensor, as stored.
        names: part name -> checkpoint tensor name (for the messages).
        shape: ``(N, K)`` of the layer's float weight.

    Raises:
        ValueError: a corrupt or mismatched tensor, named (module docstring).
    """
    n, k = shape
    missing = sorted(names.get(p, p) for p in required_parts(fmt) - set(parts))
    if missing:
        raise ValueError(f"missing {missing} ({fmt.method} stores them for every quantized layer)")
    group = k if fmt.group_size == -1 else fmt.group_size
    if k % group:
        raise ValueError(f"group_size={fmt.group_size} does not divide the input size {k} of "
                         f"{names['qweight']}")
    groups = k // group
    per_word = 32 // fmt.bits  # codes an int32
    if k % per_word or n % per_word:
        raise ValueError(f"{names['qweight']}: sizes {n}x{k} are not multiples of {per_word} (a {fmt.bits}-bit "
                         "int32 packing)")
    if fmt.method == "gptq":
        _check(names["qweight"], parts["qweight"], (k // per_word, n), _INT32)
        _check(names["scales"], parts["scales"], (groups, n), _FLOATS)
        _check(names["qzeros"], parts["qzeros"], (groups, n // per_word), _INT32)
        codes = _nibbles(parts["qweight"], 0, fmt.bits).t()  # (N, K)
        zeros = _nibbles(parts["qzeros"], 1, fmt.bits).t().float() + (1.0 if fmt.zero_plus_one else 0.0)  # (N, groups)
        scales = _check_scales(names["scales"], parts["scales"]).t()
        g_idx = _g_idx(parts.get("g_idx"), names.get("g_idx", "g_idx"), k, group, groups)
    elif fmt.method == "awq":
        _check(names["qweight"], parts["qweight"], (k, n // 8), _INT32)
        _check(names["scales"], parts["scales"], (groups, n), _FLOATS)
        _check(names["qzeros"], parts["qzeros"], (groups, n // 8), _INT32)
        order = torch.tensor(AWQ_ORDER).argsort()  # position of column j among an int32's nibbles
        unorder = torch.arange(n).reshape(-1, 8)[:, order].reshape(n)
        codes = _nibbles(parts["qweight"], 1)[:, unorder].t()  # (N, K)
        zeros = _nibbles(parts["qzeros"], 1)[:, unorder].t().float()
        scales = _check_scales(names["scales"], parts["scales"]).t()
        g_idx = torch.arange(k) // group
    else:
        stored = parts["shape"].flatten().tolist()
        if stored != [n, k]:
            raise ValueError(f"{names['shape']} is {stored}, expected {[n, k]}")
        _check(names["qweight"], parts["qweight"], (n, k // per_word), _INT32)
        _check(names["scales"], parts["scales"], (n, groups), _FLOATS)
        codes = _nibbles(parts["qweight"], 1, fmt.bits)
        scales = _check_scales(names["scales"], parts["scales"])
        if fmt.symmetric:
            zeros = torch.full((n, groups), float(1 << (fmt.bits - 1)))  # the packing's offset: 8 or 128
        else:
            _check(names["qzeros"], parts["qzeros"], (n // per_word, groups), _INT32)
            zeros = _nibbles(parts["qzeros"], 0, fmt.bits).float()
        g_idx = _g_idx(parts.get("g_idx"), names.get("g_idx", "weight_g_idx"), k, group, groups)
    return Int4Tensor(codes.contiguous(), scales.contiguous(), zeros.contiguous(), g_idx)


def _g_idx(g_idx: torch.Tensor | None, name: str, k: int, group: int, groups: int) -> torch.Tensor:
    if g_idx is None:
        return torch.arange(k) // group
    if tuple(g_idx.shape) != (k,) or g_idx.dtype.is_floating_point:
        raise ValueError(f"{name} has shape {list(g_idx.shape)} and dtype {g_idx.dtype}, expected [{k}] int32")
    g_idx = g_idx.long()
    if bool(((g_idx < 0) | (g_idx >= groups)).any()):
        raise ValueError(f"{name} holds groups outside [0, {groups}): a corrupt checkpoint")
    if not bool((torch.bincount(g_idx, minlength=groups) == group).all()):
        raise ValueError(f"{name} does not put exactly group_size={group} columns in every group")
    return g_idx
