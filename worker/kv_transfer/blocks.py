"""Blocks of a rank's paged KV cache as bytes, and back (the transfer's payload).

The payload of blocks ``ids`` is, layer by layer, the first cache tensor's rows ``ids`` then the
second's (K then V; the latent and its RoPE key for latent attention), each row
``(block_size, heads, width)`` in the cache's dtype, contiguous. Both ends check the layout
(:func:`layout_signature`) before a byte moves: a receiver with other shapes or dtype refuses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def layout_signature(caches: KVCaches) -> str:
    """The layout a peer must share: layers, each tensor's row shape, dtype (e.g. ``2x[16,1,8];[16,1,8]:float32``)."""
    if not caches:
        return "empty"
    first, second = caches[0]
    return (f"{len(caches)}x{list(first.shape[1:])};{list(second.shape[1:])}:"
            f"{str(first.dtype).removeprefix('torch.')}")


def bytes_per_block(caches: KVCaches) -> int:
    """Bytes one block takes on this rank, every layer and both tensors."""
    return sum(t[0].numel() * t.element_size() for pair in caches for t in pair)


def gather_blocks(caches: KVCaches, block_ids: Sequence[int]) -> bytes:
    """The payload of ``block_ids`` (a copy: the blocks may be reused once this returns)."""
    if not block_ids:
        return b""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=caches[0][0].device)
    parts = [t.index_select(0, index).contiguous().view(torch.uint8).reshape(-1) for pair in caches for t in pair]
    return torch.cat(parts).cpu().numpy().tobytes()


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
    device = caches[0][0].device
    index = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    flat = torch.frombuffer(payload, dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    offset = 0
    for pair in caches:
        for t in pair:
            size = len(block_ids) * t[0].numel() * t.element_size()
            rows = flat[offset:offset + size].to(device).view(t.dtype).view(len(block_ids), *t.shape[1:])
            t.index_copy_(0, index, rows)
            offset += size
