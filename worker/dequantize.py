"""FP8 and MXFP4 checkpoint tensors, dequantized to float32 while a rank reads its slice.

The formats and their config are tpserve/weight_formats.py. A quantized tensor and its
scale become one *virtual* float tensor under the name a float checkpoint would use
(``<layer>.weight`` for FP8; ``<experts>.gate_up_proj`` for MXFP4's ``gate_up_proj_blocks`` +
``gate_up_proj_scales``), so the model's ``weight_map`` and the layers' weight loaders need
no change: they index a :class:`Fp8Source` / :class:`Mxfp4Source` as they index a
safetensors slice, and get float32 of exactly the rows and columns they ask for. Each
read opens the files on the CPU and decodes only the packed values and scales that cover
that index, in float32, so a rank dequantizes only its own shard and never the whole
tensor. Its layer then casts the float32 to the model dtype, or quantizes it to int8 with
``--quantization int8`` (worker/layers/int8_weights.py).

Arithmetic (the references: transformers' ``integrations/finegrained_fp8.py``
``_dequantize_fp8_weight`` and ``integrations/mxfp4.py`` ``convert_moe_packed_tensors``):

* FP8: ``w[n, k] = float(weight[n, k]) * scale[n // bn, k // bk]`` (block, ``scale`` of shape
  ``(ceil(N / bn), ceil(K / bk))``), ``scale[n]``
  (channel) or ``scale`` (tensor);
* MXFP4: byte ``j`` of group ``g`` holds values ``2j`` (low nibble) and ``2j + 1`` (high
  nibble) of the group's 32, each an e2m1 code (:data:`E2M1_VALUES`), times ``2 ** (s - 127)``
  for the group's e8m0 scale byte ``s``; the decoded ``(E, B, A)`` is stored transposed, so the
  virtual tensor is ``(E, A, B)``.

A corrupt checkpoint is refused while loading (``ValueError`` naming the tensor): a scale
missing, of the wrong shape, NaN, infinite, zero or negative (FP8), an e8m0 NaN (byte
255, MXFP4), a scale grid that does not fit the weight and ``weight_block_size`` (the last
block row and column may be partial: ``ceil(N / bn)`` rows of scales), an FP8 dtype other
than e4m3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tpserve.weight_formats import MXFP4_GROUP, MXFP4_GROUP_BYTES, WeightFormat

#: The 16 e2m1 codes (sign bit 3, two exponent bits, one mantissa bit; OCP MX spec v1.0, table 5).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: e8m0's NaN encoding; every other byte ``s`` is ``2 ** (s - 127)``.
E8M0_NAN = 255
E8M0_BIAS = 127
#: The code of MXFP4's zero as an 8-bit code (``q = 2 v + 12``: worker/layers/moe_mxfp4.py).
MXFP4_CODE_ZERO = 12
#: e8m0 bytes from here on (2 ** 125 and above) overflow the codes' float32 products ``s * q`` (q up to 24).
MXFP4_CODE_SCALE_LIMIT = 252
_SAFETENSORS_E4M3 = "F8_E4M3"
_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
_MXFP4_BLOCKS, _MXFP4_SCALES = "_blocks", "_scales"


@dataclass(frozen=True)
class Packed:
    """Where the parts of one virtual float tensor are stored: the values and their scale."""

    values: str
    values_file: Path
    scale: str
    scale_file: Path


def plan(files: dict[str, Path], fmt: WeightFormat) -> tuple[dict[str, Path], dict[str, Packed]]:
    """Rename a quantized checkpoint's tensors into the float checkpoint's names.

    Args:
        files: checkpoint tensor name -> file.
        fmt: the checkpoint's format.

    Returns:
        ``(virtual files, packed)``: the names the model loads (scales dropped, MXFP4's
        ``<name>_blocks`` as ``<name>``) -> file of the values, and for each virtual tensor
        built from a value and a scale tensor, where both are.

    Raises:
        ValueError: a scale whose values are missing, or MXFP4 blocks whose scales are missing.
    """
    if fmt.kind == "mxfp4":
        return _plan_mxfp4(files)
    suffix = "weight" + fmt.scale_suffix
    virtual, packed = {}, {}
    for name, path in files.items():
        if not name.endswith("." + suffix):
            virtual[name] = path
            continue
        weight = name.removesuffix(suffix) + "weight"
        if weight not in files:
            raise ValueError(f"checkpoint has {name!r} but not the weight it scales ({weight!r})")
        packed[weight] = Packed(weight, files[weight], name, path)
    return virtual, packed


def _plan_mxfp4(files: dict[str, Path]) -> tuple[dict[str, Path], dict[str, Packed]]:
    virtual, packed = {}, {}
    for name, path in files.items():
        if name.endswith(_MXFP4_SCALES):
            if name.removesuffix(_MXFP4_SCALES) + _MXFP4_BLOCKS not in files:
                raise ValueError(f"checkpoint has {name!r} but not its blocks "
                                 f"({name.removesuffix(_MXFP4_SCALES) + _MXFP4_BLOCKS!r})")
            continue
        if not name.endswith(_MXFP4_BLOCKS):
            virtual[name] = path
            continue
        base = name.removesuffix(_MXFP4_BLOCKS)
        if base + _MXFP4_SCALES not in files:
            raise ValueError(f"mxfp4 tensor {name!r} has no scales ({base + _MXFP4_SCALES!r} is missing)")
        virtual[base] = path
        packed[base] = Packed(name, path, base + _MXFP4_SCALES, files[base + _MXFP4_SCALES])
    return virtual, packed


def source(packed: Packed, fmt: WeightFormat, files: OpenFiles) -> Fp8Source | Mxfp4Source:
    """The float32 view of one packed tensor, indexed like a safetensors slice, read through ``files``.

    Raises:
        ValueError: the stored shapes or dtypes do not fit the format (names the tensor).
    """
    if fmt.kind == "mxfp4":
        return Mxfp4Source(packed, files)
    return Fp8Source(packed, fmt, files)


def check_not_fp8(name: str, dtype: str, fmt: WeightFormat) -> None:
    """Refuse an FP8 tensor read as a float one: it has no scale in the checkpoint."""
    if dtype in _FP8_DTYPES:
        raise ValueError(f"fp8 tensor {name!r} has no scale (weight{fmt.scale_suffix or '_scale'} is missing)")


def _slices(index: Any, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(start, stop)`` per dimension of a tuple of step-1 slices (missing trailing ones: whole)."""
    index = index if isinstance(index, tuple) else (index,)
    out = []
    for dim, size in enumerate(shape):
        part = index[dim] if dim < len(index) else slice(None)
        start, stop, step = part.indices(size)
        if step != 1:
            raise ValueError(f"a strided read ({part}) of a quantized tensor")
        out.append((start, stop))
    return out


class OpenFiles:
    """The checkpoint files opened on the CPU for reading packed tensors, each opened once per load.

    A DeepSeek V3 checkpoint holds tens of thousands of expert tensors, each read with its
    scale, often from another file; opening (parsing the header of) a file per read would
    cost more than the reads. The handles are memory maps: closing drops them.
    """

    def __init__(self) -> None:
        self._handles: dict[Path, Any] = {}

    def open_slice(self, path: Path, name: str) -> Any:
        """The safetensors slice of ``name`` in ``path`` (shape, dtype, and indexing that reads only the index)."""
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt", device="cpu")
        return self._handles[path].get_slice(name)

    def read(self, path: Path, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self.open_slice(path, name)[index]

    def stored(self, path: Path, name: str) -> tuple[tuple[int, ...], str]:
        """``(shape, safetensors dtype name)`` of a stored tensor, from the header."""
        part = self.open_slice(path, name)
        return tuple(part.get_shape()), part.get_dtype()

    def close(self) -> None:
        self._handles.clear()


class Fp8Source:
    """An e4m3 ``weight`` ``(N, K)`` and its scale as a float32 ``(N, K)`` checkpoint source.

    The whole scale tensor (per block, per channel or one) is read and checked once, at
    construction: it is at most ``N * K / (bn * bk)`` floats.
    """

    def __init__(self, packed: Packed, fmt: WeightFormat, files: OpenFiles) -> None:
        self.packed, self.files = packed, files
        shape, dtype = files.stored(packed.values_file, packed.values)
        if dtype != _SAFETENSORS_E4M3:
            raise ValueError(f"tensor {packed.values!r} is {dtype}, expected {_SAFETENSORS_E4M3} (fp8 e4m3)")
        if len(shape) != 2:
            raise ValueError(f"fp8 tensor {packed.values!r} has shape {list(shape)}: only 2-D weights are served")
        self.shape: tuple[int, int] = (shape[0], shape[1])
        self.block = fmt.block
        scale = files.read(packed.scale_file, packed.scale, ()).float()
        self.scale = self._checked(scale)

    def _checked(self, scale: torch.Tensor) -> torch.Tensor:
        """The scale as ``(ceil(N / bn), ceil(K / bk))`` (block), ``(N, 1)`` (channel) or ``(1, 1)`` (tensor).

        A block size that does not divide the weight leaves partial blocks on the last block
        row and column, each with its own scale (DeepSeek V3's 576-row ``kv_a_proj_with_mqa`` at
        128; transformers' ``_dequantize_fp8_weight`` and vLLM read them so).
        """
        rows, columns = self.shape
        name = self.packed.scale
        if self.block is not None:
            bn, bk = self.block
            expected: tuple[tuple[int, ...], ...] = ((math.ceil(rows / bn), math.ceil(columns / bk)),)
        else:
            expected = ((), (1,), (1, 1), (rows,), (rows, 1))
        if tuple(scale.shape) not in expected:
            raise ValueError(f"scale {name!r} has shape {list(scale.shape)}, expected "
                             f"{' or '.join(str(list(e)) for e in expected)} for weight [{rows}, {columns}]")
        bad = ~torch.isfinite(scale) | (scale <= 0)
        if bool(bad.any()):
            value = float(scale.reshape(-1)[bad.reshape(-1)][0])
            raise ValueError(f"scale {name!r} holds {int(bad.sum())} non-finite or non-positive values "
                             f"(first {value}): a corrupt checkpoint")
        return scale if self.block else scale.reshape(-1, 1)

    def get_shape(self) -> tuple[int, int]:
        return self.shape

    def read_codes(self, rows: tuple[int, int], columns: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored e4m3 values of ``w[r0:r1, c0:c1]`` and their scales, for a layer that keeps them
        (``--quantization fp8``, worker/layers/fp8_weights.py): ``(codes (r, c) float8_e4m3fn, scale (r, c / G)
        float32)`` with ``w = codes * scale[:, k // G]``. ``G``: the whole slice for a scale per channel or
        tensor; for block scales the largest size whose groups each lie in one checkpoint block,
        ``gcd(bk, c0, c1 - c0)`` (a shard that starts inside a block gets smaller groups).
        """
        (r0, r1), (c0, c1) = rows, columns
        codes = _check_e4m3(self.files.read(self.packed.values_file, self.packed.values, (slice(r0, r1), slice(c0, c1))),
                            self.packed.values)
        if self.block is None:
            scale = self.scale if self.scale.shape[0] == 1 else self.scale[r0:r1]  # (1 | rows, 1)
            return codes, scale.expand(r1 - r0, 1).contiguous()
        bn, bk = self.block
        group = math.gcd(bk, c0, c1 - c0)
        block_rows = torch.arange(r0, r1) // bn  # (r,)
        block_columns = torch.arange(c0, c1, group) // bk  # (c / G,): each group's checkpoint block
        return codes, self.scale[block_rows[:, None], block_columns[None, :]].contiguous()

    def __getitem__(self, index: Any) -> torch.Tensor:
        """Float32 ``w[rows, columns]`` for step-1 slices ``index``."""
        (r0, r1), (c0, c1) = _slices(index, self.shape)
        w = _check_e4m3(self.files.read(self.packed.values_file, self.packed.values, (slice(r0, r1), slice(c0, c1))),
                        self.packed.values).float()
        if self.block is None:
            scale = self.scale if self.scale.shape[0] == 1 else self.scale[r0:r1]  # (1 | rows, 1)
            return w * scale
        bn, bk = self.block
        # The scale blocks covering the slice, expanded over rows only (rows x column blocks: small),
        # then applied one block column at a time, so no second weight-sized tensor is made.
        first_column_block = c0 // bk
        blocks = self.scale[r0 // bn:math.ceil(r1 / bn), first_column_block:math.ceil(c1 / bk)]
        per_row = blocks.repeat_interleave(bn, dim=0)[r0 % bn:r0 % bn + (r1 - r0)]  # (rows, column blocks)
        for j in range(per_row.shape[1]):
            start = max(c0, (first_column_block + j) * bk) - c0
            stop = min(c1, (first_column_block + j + 1) * bk) - c0
            w[:, start:stop] *= per_row[:, j:j + 1]
        return w


def _check_e4m3(codes: torch.Tensor, name: str) -> torch.Tensor:
    """``codes`` (any shape, float8_e4m3fn) as read, once none is NaN.

    e4m3fn has no infinities and one NaN pattern per sign, ``S.1111.111`` (0x7F, 0xFF: the OCP 8-bit floating
    point specification, the format FP8 checkpoints store); a NaN weight would make every logit NaN (dequantized)
    or be read as a finite value by the kernel that keeps the codes, so a checkpoint holding one is refused.

    Raises:
        ValueError: naming the tensor and how many NaN codes its slice holds.
    """
    nan = (codes.view(torch.uint8) & 0x7F) == 0x7F
    if bool(nan.any()):
        count = int(nan.sum())
        raise ValueError(f"fp8 tensor {name!r} holds {count} NaN {'value' if count == 1 else 'values'} (e4m3 code "
                         "0x7F or 0xFF): a corrupt checkpoint")
    return codes


class Mxfp4Source:
    """MXFP4 ``<name>_blocks`` ``(E, B, G, 16)`` + ``<name>_scales`` ``(E, B, G)`` as float32 ``(E, G * 32, B)``."""

    def __init__(self, packed: Packed, files: OpenFiles) -> None:
        self.packed, self.files = packed, files
        blocks, blocks_dtype = files.stored(packed.values_file, packed.values)
        scales, scales_dtype = files.stored(packed.scale_file, packed.scale)
        if len(blocks) != 4 or blocks[-1] != MXFP4_GROUP_BYTES:
            raise ValueError(f"mxfp4 tensor {packed.values!r} has shape {list(blocks)}, expected "
                             f"[experts, rows, groups, {MXFP4_GROUP_BYTES}]")
        if scales != blocks[:-1]:
            raise ValueError(f"mxfp4 scales {packed.scale!r} have shape {list(scales)}, expected {list(blocks[:-1])} "
                             f"(one per {MXFP4_GROUP} values of {packed.values!r})")
        for name, dtype in ((packed.values, blocks_dtype), (packed.scale, scales_dtype)):
            if dtype != "U8":
                raise ValueError(f"mxfp4 tensor {name!r} is {dtype}, expected U8")
        experts, rows, groups, _ = blocks
        self.shape = (experts, groups * MXFP4_GROUP, rows)

    def get_shape(self) -> tuple[int, int, int]:
        return self.shape

    def __getitem__(self, index: Any) -> torch.Tensor:
        """Float32 ``w[experts, a, b]`` of the virtual ``(E, A, B)`` tensor for step-1 slices ``index``."""
        (e0, e1), (a0, a1), (b0, b1) = _slices(index, self.shape)
        g0, g1 = a0 // MXFP4_GROUP, math.ceil(a1 / MXFP4_GROUP)  # the groups covering [a0, a1)
        stored = (slice(e0, e1), slice(b0, b1), slice(g0, g1))
        blocks = self.files.read(self.packed.values_file, self.packed.values, stored)  # (e, b, g, 16) uint8
        scales = self.files.read(self.packed.scale_file, self.packed.scale, stored)  # (e, b, g) uint8
        if bool((scales == E8M0_NAN).any()):
            raise ValueError(f"mxfp4 scales {self.packed.scale!r} hold {int((scales == E8M0_NAN).sum())} NaN "
                             "(e8m0 255) values: a corrupt checkpoint")
        values = dequantize_mxfp4(blocks, scales)  # (e, b, g * 32)
        first = a0 - g0 * MXFP4_GROUP
        return values[..., first:first + (a1 - a0)].transpose(1, 2)  # (e, a, b)


    def read_w8(self, experts: tuple[int, int], rows: tuple[int, int], columns: tuple[int, int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The virtual tensor's ``w[experts, columns, rows]`` as exact 8-bit codes and group scale/offset pairs,
        laid out ``(out, in)`` (rows ``B`` out, columns ``A`` in, as ``F.linear`` takes them):
        ``q (e, b, a)`` uint8 and ``scale_offset (e, b, a / 32, 2)`` float32 with ``w = s * q + o``.

        An e2m1 value is a multiple of 0.5 up to 6, so ``2 v`` is an integer in [-12, 12]: ``q = 2 v + 12`` in
        [0, 24], ``s = 2 ** (e - 128)`` for the group's e8m0 byte ``e``, ``o = -12 s`` (exact in float32;
        worker/layers/moe_mxfp4.py says why 12). ``columns`` must be whole groups of 32.

        Raises:
            ValueError: an e8m0 NaN scale (names the tensor), or columns not whole groups.
        """
        (e0, e1), (b0, b1), (a0, a1) = experts, rows, columns
        if a0 % MXFP4_GROUP or a1 % MXFP4_GROUP:
            raise ValueError(f"mxfp4 columns [{a0}, {a1}) of {self.packed.values!r} are not whole groups of "
                             f"{MXFP4_GROUP}")
        stored = (slice(e0, e1), slice(b0, b1), slice(a0 // MXFP4_GROUP, a1 // MXFP4_GROUP))
        blocks = self.files.read(self.packed.values_file, self.packed.values, stored)  # (e, b, g, 16) uint8
        scales = self.files.read(self.packed.scale_file, self.packed.scale, stored)  # (e, b, g) uint8
        if bool((scales == E8M0_NAN).any()):
            raise ValueError(f"mxfp4 scales {self.packed.scale!r} hold {int((scales == E8M0_NAN).sum())} NaN "
                             "(e8m0 255) values: a corrupt checkpoint")
        if bool((scales >= MXFP4_CODE_SCALE_LIMIT).any()):  # s * 24 overflows float32
            raise ValueError(f"mxfp4 scales {self.packed.scale!r} hold e8m0 exponents of 2**125 and above, past "
                             "float32's range: a corrupt checkpoint")
        doubled = torch.tensor([2 * v for v in E2M1_VALUES], dtype=torch.int16)  # 2 v: integers in [-12, 12]
        codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # (e, b, g, 16, 2): low nibble first
        q = (doubled[codes].flatten(-3) + MXFP4_CODE_ZERO).to(torch.uint8)  # (e, b, a) in [0, 24]
        s = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32) - (E8M0_BIAS + 1))  # (e, b, g): 2 ** (e - 128)
        return q, torch.stack([s, -MXFP4_CODE_ZERO * s], dim=-1)  # (e, b, a), (e, b, g, 2)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 to float32: ``(..., G, 16)`` uint8 codes and ``(..., G)`` uint8 e8m0 scales -> ``(..., G * 32)``.

    Formula in the module docstring (value ``2j`` is byte ``j``'s low nibble).
    """
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).int()  # (..., G, 16, 2): low nibble first
    values = table[codes].flatten(-2)  # (..., G, 32)
    exponents = scales.to(torch.int32) - E8M0_BIAS  # (..., G)
    return torch.ldexp(values, exponents[..., None].float()).flatten(-2)
