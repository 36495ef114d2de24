"""Blocks of a rank's paged KV cache as one byte string, and back: the transfer's payload.

The copying is worker/kv_block_io.py's (every cache layout); this module only lays the copies
out for the wire. The payload of blocks ``ids`` is, layer by layer, the first cache tensor's rows
``ids`` then the second's (K then V; the latent and its RoPE key for latent attention), each row
``(block_size, heads, width)`` in the cache's dtype, contiguous. Both ends check the layout
(:func:`layout_signature`) before a byte moves: a receiver with other shapes or dtype refuses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.kv_block_io import KVCaches
from worker.kv_block_io import gather_blocks as gather_tensors
from worker.kv_block_io import scatter_blocks as scatter_tensors


def layout_signature(caches: KVCaches) -> str:
    """The layout a peer must share: layers, each tensor's row shape, dtype (e.g. ``2x[16, 1, 8];[16, 1, 8]:float32``)."""
    if not caches:
        return "empty"
    first, second = caches[0]
    return (f"{len(caches)}x{list(first.shape[1:])};{list(second.shape[1:])}:"
            f"{str(first.dtype).removeprefix('torch.')}")


def bytes_per_block(caches: KVCaches) -> int:
    """Bytes one block takes on this rank, every layer and both tensors."""
    return sum(t[0].numel() * t.element_size() for pair in caches for t in pair)


def gather_blocks(caches: KVCaches, block_ids: Sequence[int]) -> bytes:
    """The payload of ``block_ids`` (a copy, in host memory: the blocks may be reused once this returns)."""
    if not block_ids:
        return b""
    pairs = gather_tensors(caches, list(block_ids), torch.device("cpu"))
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for pair in pairs for t in pair)


def scatter_blocks(caches: KVCaches, block_ids: Sequence[int], payload: bytes | bytearray) -> None:
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
