"""Blocks of a rank's paged KV cache as one byte string, and back: the transfer's payload.

The copying is worker/kv_block_io.py's (every cache layout); this module only lays the copies
out for the wire. The payload of blocks ``ids`` is, tensor pair by pair, the first tensor's rows
``ids`` then the second's (per layer K then V; the latent and its RoPE key for latent attention;
an 8-bit cache's per-token scale pools after the layers, worker/kv_quant.py), each row
``(block_size, heads, width)`` (a scale pool's ``(heads, block_size)``) in the tensor's dtype,
contiguous. Both ends check the layout (:func:`layout_signature`) before a byte moves: a receiver
with other shapes, dtypes or 8-bit codec refuses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.kv_block_io import KVCaches
from worker.kv_block_io import gather_blocks as gather_tensors
from worker.kv_block_io import scatter_blocks as scatter_tensors


def layout_signature(caches: KVCaches, codec: str = "") -> str:
    """The layout a peer must share: runs of tensor pairs with the same row shapes and dtype, and the codec.

    E.g. ``2x[16, 1, 8];[16, 1, 8]:float32`` (two layers of a float cache) or
    ``5x[16, 4, 8];[16, 4, 8]:int8+5x[4, 16];[4, 16]:bfloat16|int8:...`` (an 8-bit cache's codes, then its
    scale pools, then ``codec``: what the codes mean beyond their bytes, the runner's
    :attr:`~worker.model_runner.ModelRunner.kv_codec`; "" for a float cache).
    """
    if not caches:
        return "empty"
    runs: list[list] = []  # [count, description]
    for first, second in caches:
        described = f"{list(first.shape[1:])};{list(second.shape[1:])}:{str(first.dtype).removeprefix('torch.')}"
        if second.dtype != first.dtype:
            described += f"/{str(second.dtype).removeprefix('torch.')}"
        if runs and runs[-1][1] == described:
            runs[-1][0] += 1
        else:
            runs.append([1, described])
    signature = "+".join(f"{count}x{described}" for count, described in runs)
    return f"{signature}|{codec}" if codec else signature


def layout_mismatch(reader: str, holder: str) -> str:
    """Why a reader's layout signature cannot take a holder's blocks, in words (one line): the cache types
    when they differ (``--kv-cache-dtype``), the 8-bit key offsets' calibration, else both signatures."""
    def codec(signature: str) -> tuple[str, str]:  # (storage type, the rest of the codec)
        layers, _, rest = signature.partition("|")
        if rest:
            kind, _, detail = rest.partition(":")
            return kind, detail
        return layers.rpartition(":")[2].partition("+")[0] or "?", ""  # a float cache: its dtype

    (reader_kind, reader_detail), (holder_kind, holder_detail) = codec(reader), codec(holder)
    if reader_kind != holder_kind:
        return (f"the reading (decode) replica's KV cache stores {reader_kind}, this (prefill) replica's "
                f"{holder_kind}: both replicas need the same --kv-cache-dtype")
    if reader_detail != holder_detail:
        return (f"the replicas' 8-bit caches were calibrated differently ({reader_detail} against {holder_detail}: "
                "another model or hardware computed other key offsets)")
    return f"cache layout {reader} is not this rank's {holder}"


def bytes_per_block(caches: KVCaches) -> int:
    """Bytes one block takes on this rank, every layer and both tensors."""
    return sum(t[0].numel() * t.element_size() for pair in caches for t in pair)


def gather_blocks(caches: KVCaches, block_ids: Sequence[int]) -> bytes:
    """The payload of ``block_ids`` (a copy, in host memory: the blocks may be reused once this returns)."""
    if not block_ids:
        return b""
    pairs = gather_tensors(caches, list(block_ids), torch.device("cpu"))
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for pair in pairs for t in pair)


def scatter_blocks(caches: KVCaches, block_ids: Sequence[int], payload: bytes | bytearray | memoryview) -> None:
    """Writes :func:`gather_blocks`' ``payload`` into blocks ``block_ids`` of this rank's cache.

    Raises:
        ValueError: the payload's size is not ``len(block_ids)`` blocks of this layout.
    """
    expected = len(block_ids) * bytes_per_block(caches)
    if len(payload) != expected:
        raise ValueError(f"a payload of {len(payload)} bytes for {len(block_ids)} blocks of {expected} bytes")
    if not block_ids:
        return
    flat = torch.frombuffer(payload, dtype=torch.uint8)
    data, offset, n = [], 0, len(block_ids)
    for pair in caches:
        rows = []
        for t in pair:
            size = n * t[0].numel() * t.element_size()
            rows.append(flat[offset:offset + size].view(t.dtype).view(n, *t.shape[1:]))
            offset += size
        data.append((rows[0], rows[1]))
    scatter_tensors(caches, list(block_ids), data)
