"""Packed int4 codes: the layout the int4 kernel reads, packing into it, and the one int4 matmul.

Layout (the compiled kernel's, worker/kernels/cpu_linear_int4.cpp; every int4 source is
repacked into it at load, worker/layers/int4_weights.py):

* ``qweight (N, K / 2)`` uint8: codes ``q`` in ``[0, 15]``, in blocks of 32 columns; block
  ``b`` is bytes ``16b .. 16b + 15``, byte ``j`` holding column ``32b + j`` in its low nibble
  and column ``32b + 16 + j`` in its high nibble (two masks give two runs of 16 columns).
* ``scale_offset (N, K / G, 2)`` float32: per row and group of ``G`` columns (a multiple of
  32 dividing ``K``), ``(s, o)`` with ``w = s * q + o``; a zero point ``z`` is ``o = -s * z``.

So a weight costs 4 bits plus ``64 / G`` bits of scale and offset: 4.5 bits at ``G = 128``.

The tile layout (worker/kernels/cpu_linear_int4_tiles.cpp; :func:`pack_tiles`, at load where
:func:`tile_layout_applies`: an AMX-INT8 or AVX512-VNNI CPU, rows a multiple of 16, columns and groups of
128): the same bytes in the order AMX's B operand reads them, so a decode step streams W front to back (the
VNNI kernel reads the same blocks, a row of W an int32 lane).

* ``qweight (N, K / 2)`` uint8 in blocks of 1,024 bytes, block ``(t, c)`` (rows ``16t ..
  16t + 15``, columns ``128c .. 128c + 127``) at ``(t * K / 128 + c) * 1024``; its byte
  ``64r + 4j + i`` holds row ``16t + j``'s column ``128c + 4r + i`` in the low nibble and column
  ``128c + 64 + 4r + i`` in the high one;
* ``scale_offset (N / 16, K / G, 2, 16)`` float32: per block of 16 rows and group, the 16 rows'
  scales, then their offsets. A layer's layout is told by ``scale_offset.dim()`` (3 or 4).
"""

from __future__ import annotations

import torch

from worker.kernels import cpu_kernels_available

#: Columns per 16-byte block of codes.
BLOCK = 32
#: The tile layout's block: rows of W (AMX B's 16 int32 columns) and columns (two B tiles of 64).
TILE_ROWS, TILE_COLUMNS = 16, 128


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """``(N, K)`` integer codes in ``[0, 15]`` -> ``(N, K / 2)`` uint8 in the kernel's block layout.

    Raises:
        ValueError: ``K`` is not a multiple of 32, or a code is outside ``[0, 15]``.
    """
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"int4 layout needs the input size to be a multiple of {BLOCK}, got {k}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("int4 codes must lie in [0, 15]")
    blocks = q.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)  # (N, blocks, low/high half, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``(N, K / 2)`` uint8 -> ``(N, K)`` uint8 codes."""
    n, half = qweight.shape
    blocks = qweight.reshape(n, half // (BLOCK // 2), 1, BLOCK // 2)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=2).reshape(n, half * 2)


def pack_tiles(qweight: torch.Tensor, scale_offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row-major layout -> the tile layout (module docstring): same bytes, W's order for AMX tiles (which the
    AVX512-VNNI kernel reads as they are).

    ``qweight (N, K / 2)`` uint8 -> ``(N, K / 2)`` uint8 in 1,024-byte blocks of 16 rows x 128 columns;
    ``scale_offset (N, K / G, 2)`` -> ``(N / 16, K / G, 2, 16)`` float32.

    Raises:
        ValueError: ``N`` is not a multiple of 16, ``K`` of 128, or ``G`` of 128.
    """
    n, k = qweight.shape[0], qweight.shape[1] * 2
    groups = scale_offset.shape[1]
    if n % TILE_ROWS or k % TILE_COLUMNS or (k // groups) % TILE_COLUMNS:
        raise ValueError(f"the int4 tile layout needs rows a multiple of {TILE_ROWS} and columns and groups of "
                         f"{TILE_COLUMNS}, got N={n} K={k} G={k // groups}")
    # codes[t, j, c, h, r, i]: row 16 t + j, column 128 c + 64 h + 4 r + i.
    codes = unpack_codes(qweight).reshape(n // TILE_ROWS, TILE_ROWS, k // TILE_COLUMNS, 2, 16, 4)
    blocks = codes.permute(0, 2, 4, 1, 5, 3)  # (t, c, r, j, i, h): byte 4 j + i of a block's row r
    packed = (blocks[..., 0] | (blocks[..., 1] << 4)).reshape(n, k // 2).contiguous()
    scales = scale_offset.reshape(n // TILE_ROWS, TILE_ROWS, groups, 2).permute(0, 2, 3, 1).contiguous()
    return packed, scales


def unpack_tiles(qweight: torch.Tensor, scale_offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_tiles`: the tile layout -> ``(N, K)`` uint8 codes and ``(N, K / G, 2)`` float32."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    blocks = qweight.reshape(n // TILE_ROWS, k // TILE_COLUMNS, 16, TILE_ROWS, 4)  # (t, c, r, j, i)
    halves = torch.stack([blocks & 0x0F, blocks >> 4], dim=5)  # (t, c, r, j, i, h)
    codes = halves.permute(0, 3, 1, 5, 2, 4).reshape(n, k)
    return codes, scale_offset.permute(0, 3, 1, 2).reshape(n, scale_offset.shape[1], 2)


def tile_layout_applies(qweight: torch.Tensor, scale_offset: torch.Tensor) -> bool:
    """Whether a row-major layer should be repacked by :func:`pack_tiles` at load: a CPU layer whose rows
    divide by 16 and columns and groups by 128, on a CPU with AMX-INT8 (whose kernel gives this process the tiles)
    or AVX512-VNNI (``torch.ops.tpserve_cpu.int4_tiles_enabled``; ``use_int4_tiles(False)`` keeps the row-major
    layout)."""
    if qweight.device.type != "cpu" or is_tile_layout(scale_offset) or not cpu_kernels_available():
        return False
    n, k = qweight.shape[0], qweight.shape[1] * 2
    groups = scale_offset.shape[1]
    fits = n % TILE_ROWS == 0 and k % TILE_COLUMNS == 0 and groups > 0 and (k // groups) % TILE_COLUMNS == 0
    return fits and bool(torch.ops.tpserve_cpu.int4_tiles_enabled())


def repack_tile_stack(qweight: torch.Tensor, scale_offset: torch.Tensor) -> torch.Tensor:
    """:func:`pack_tiles` on each matrix of a stack (MoE experts), in place: every expert a tile-layout layer.

    Args:
        qweight: ``(E, N, K / 2)`` uint8, row-major; rewritten in place, each expert's bytes in the tile
            order (one expert's copy at a time, never a second stack: load-time memory stays flat).
        scale_offset: ``(E, N, K / G, 2)`` float32.

    Returns:
        ``(E, N / 16, K / G, 2, 16)`` float32, so expert ``e``'s ``qweight[e]`` / ``result[e]`` is a
        tile-layout layer that ``linear_int4`` takes as it is.

    Raises:
        ValueError: ``N`` is not a multiple of 16, ``K`` of 128, or ``G`` of 128 (as :func:`pack_tiles`);
            ``qweight`` is then unchanged.
    """
    experts, n = qweight.shape[:2]
    groups = scale_offset.shape[2]
    if n % TILE_ROWS:
        raise ValueError(f"the int4 tile layout needs rows a multiple of {TILE_ROWS}, got N={n}")
    scales = scale_offset.new_empty((experts, n // TILE_ROWS, groups, 2, TILE_ROWS))
    for e in range(experts):
        packed, scales[e] = pack_tiles(qweight[e], scale_offset[e])  # raises before the first write
        qweight[e].copy_(packed)
    return scales


def tile_layout_layers(model: torch.nn.Module) -> int:
    """How many of ``model``'s int4 weights were repacked into the tile layout at load: dense layers
    (``weight_scale`` of 4 dimensions) and MoE expert stacks (a scale of 5 dimensions, one per stack)."""
    return sum(1 for name, p in model.named_parameters()
               if (name.endswith("weight_scale") and p.dim() == 4) or (name.endswith("_proj_scale") and p.dim() == 5))


def is_tile_layout(scale_offset: torch.Tensor) -> bool:
    """Whether a layer's ``scale_offset`` is the tile layout's ``(N / 16, K / G, 2, 16)`` (else ``(N, K / G, 2)``)."""
    return scale_offset.dim() == 4


def dequantize(qweight: torch.Tensor, scale_offset: torch.Tensor) -> torch.Tensor:
    """``w = s * q + o`` as float32 ``(N, K)`` (the reference the kernel is tested against), either layout."""
    if is_tile_layout(scale_offset):
        codes, scale_offset = unpack_tiles(qweight, scale_offset)
        q = codes.float()  # (N, K)
    else:
        q = unpack_codes(qweight).float()  # (N, K)
    n, k = q.shape
    groups = scale_offset.shape[1]
    q = q.reshape(n, groups, k // groups)
    return (q * scale_offset[:, :, :1] + scale_offset[:, :, 1:]).reshape(n, k)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scale_offset: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only int4 linear: ``x @ W.T + bias`` with ``W = s * q + o`` group-wise (module docstring).

    Args:
        x: ``(T, K)`` activations in the model dtype.
        qweight: ``(N, K / 2)`` uint8, packed codes.
        scale_offset: ``(N, K / G, 2)`` float32.
        bias: ``(N,)`` or None.

    Returns:
        ``(T, N)`` in ``x.dtype``. float32 activations on a CPU with the compiled kernels take
        ``torch.ops.tpserve_cpu.linear_int4`` (codes widened in registers, float32 accumulation);
        elsewhere W is dequantized to ``x.dtype`` and multiplied by torch (a fallback: it reads
        W as floats).
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and cpu_kernels_available():
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()
        return torch.ops.tpserve_cpu.linear_int4(x.contiguous(), qweight, scale_offset, bias)  # (T, N)
    w = dequantize(qweight, scale_offset).to(x.dtype)  # (N, K)
    return torch.nn.functional.linear(x, w, bias)  # (T, N)
