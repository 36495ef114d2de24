"""Reading whole KV blocks out of a rank's paged cache, and writing them back in.

The one place that knows how a block id maps onto a rank's cache tensors, for everything
that moves blocks rather than computing them: the host tier of the prefix cache
(worker/kv_host_tier.py: a block evicted from the device pool, a sequence swapped out) and
the transfer of blocks between replicas (prefill -> decode).

A rank's cache is a list of per-layer pairs ``(first, second)``, each
``(num_blocks, block_size, heads, width)`` (worker/kv_cache.py), for every layout it serves:

* per-head K/V (grouped-query attention): ``heads`` is this rank's KV heads, so each rank moves
  its own slice of every block (the same block ids on every rank: tensor parallelism needs no
  exchange);
* latent (multi-head latent attention): the compressed latent and the RoPE key, the same
  tensors on every rank;
* 8-bit K/V (``--kv-cache-dtype int8|fp8``): the codes as stored. Their scales are per layer,
  head and channel and fixed for the server's life (worker/kv_quant.py), never per block, so a
  block's codes are all of it: written back into the same server they read exactly as before.

A block is copied with its whole ``block_size`` positions, written or not. Nothing here decides
which blocks move: the coordinator does, the ranks copy.

On the CPU the copies are numpy's fancy indexing over the tensors' bytes (shared memory, no
copy to get there), not torch's ``index_select`` / ``index_copy_``: those open an OpenMP parallel
region per tensor, which for a few blocks costs more than the copy, and on a loaded host far
more (64 blocks of 4 layers on 2 threads: 2 ms single-threaded, 30-270 ms in parallel regions
while other processes held the cores; docs/design/scheduling.md, "The host tier").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

#: Per layer, the ``(first, second)`` cache tensors of worker/kv_cache.py.
KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def _index(block_ids: Sequence[int] | torch.Tensor, num_blocks: int, device: torch.device,
           distinct: bool = False) -> torch.Tensor:
    """``block_ids`` as an int64 index tensor on ``device``, checked against the pool's size (and for
    repeats when ``distinct``). A plan's ids arrive as Python ints: checked as such, no tensor op."""
    ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else list(block_ids)
    if ids and not isinstance(ids[0], int):
        raise ValueError(f"block_ids must be one-dimensional ints, got {block_ids!r:.80}")
    if ids and (min(ids) < 0 or max(ids) >= num_blocks):
        bad = [b for b in ids if not 0 <= b < num_blocks]
        raise ValueError(f"block ids {bad} outside [0, {num_blocks})")
    if distinct and len(set(ids)) != len(ids):
        raise ValueError(f"scatter_blocks: repeated block ids in {ids}")
    return torch.tensor(ids, dtype=torch.int64, device=device)


def _host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as a ``(rows, bytes per row)`` uint8 array (no copy)."""
    return tensor.view(torch.uint8).numpy().reshape(tensor.shape[0], -1)


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """A one-byte float tensor as its bytes (torch has no CPU ``index_copy_`` for float8); others as they are."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 and tensor.is_floating_point() else tensor


def gather_blocks(kv_caches: KVCaches, block_ids: Sequence[int] | torch.Tensor,
                  device: torch.device | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of blocks ``block_ids`` of every layer's two cache tensors, in ``block_ids``' order.

    Args:
        kv_caches: per layer, ``(first, second)``, each ``(num_blocks, block_size, heads, width)``.
        block_ids: ``(n,)`` block ids in ``[0, num_blocks)``; repeats allowed.
        device: where the copies go (None: the cache's device); a CUDA to CPU copy waits for it.

    Returns:
        Per layer, ``(first[block_ids], second[block_ids])``, each ``(n, block_size, heads, width)``
        in the cache's dtype (8-bit codes stay codes), new tensors.

    Raises:
        ValueError: an empty cache list, or a block id outside the pool.
    """
    if not kv_caches:
        raise ValueError("gather_blocks: no cache tensors (init_kv_cache first)")
    first = kv_caches[0][0]
    index = _index(block_ids, first.shape[0], first.device)
    out = []
    if first.device.type == "cpu" and (device is None or device.type == "cpu"):  # numpy: no parallel regions
        rows = index.numpy()
        for caches in kv_caches:
            pair = [torch.from_numpy(_host_bytes(c)[rows]).view(c.dtype).view(len(rows), *c.shape[1:])
                    for c in caches]
            out.append((pair[0], pair[1]))
        return out
    for k_cache, v_cache in kv_caches:
        k = _raw(k_cache).index_select(0, index).view(k_cache.dtype)  # (n, block_size, heads, width)
        v = _raw(v_cache).index_select(0, index).view(v_cache.dtype)
        out.append((k, v) if device is None else (k.to(device), v.to(device)))
    return out


def scatter_blocks(kv_caches: KVCaches, block_ids: Sequence[int] | torch.Tensor,
                   data: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Writes ``data`` (as :func:`gather_blocks` returns it) into blocks ``block_ids``, in place.

    Args:
        kv_caches: per layer, ``(first, second)``, each ``(num_blocks, block_size, heads, width)``.
        block_ids: ``(n,)`` distinct block ids in ``[0, num_blocks)``: ``data``'s row ``i`` goes to
            block ``block_ids[i]``.
        data: per layer, ``(first, second)``, each ``(n, block_size, heads, width)`` of the cache's
            dtype, on any device (copied to the cache's).

    Raises:
        ValueError: a layer count, shape or dtype that differs from the cache's (the message names
            the layer and both), a repeated block id, or a block id outside the pool. Nothing is
            written then.
    """
    if len(data) != len(kv_caches):
        raise ValueError(f"scatter_blocks: {len(data)} layers of data for a cache of {len(kv_caches)} layers")
    if not kv_caches:
        return
    first = kv_caches[0][0]
    index = _index(block_ids, first.shape[0], first.device, distinct=True)
    for layer, (caches, rows) in enumerate(zip(kv_caches, data)):  # every check before any write
        for cache, row in zip(caches, rows):
            expected = (index.numel(), *cache.shape[1:])
            if tuple(row.shape) != expected or row.dtype != cache.dtype:
                raise ValueError(f"scatter_blocks: layer {layer} data {tuple(row.shape)} {row.dtype}, the cache "
                                 f"takes {expected} {cache.dtype}")
    if first.device.type == "cpu":  # numpy: no parallel regions (module docstring)
        targets = index.numpy()
        for caches, pair in zip(kv_caches, data):
            for cache, values in zip(caches, pair):
                _host_bytes(cache)[targets] = _host_bytes(values.to("cpu").contiguous())
        return
    for (k_cache, v_cache), (k, v) in zip(kv_caches, data):
        _raw(k_cache).index_copy_(0, index, _raw(k.to(k_cache.device, non_blocking=True)))
        _raw(v_cache).index_copy_(0, index, _raw(v.to(v_cache.device, non_blocking=True)))


def copy_blocks(src: KVCaches, src_ids: Sequence[int], dst: KVCaches, dst_ids: Sequence[int]) -> None:
    """Copies block ``src_ids[i]`` of ``src`` into block ``dst_ids[i]`` of ``dst``, every layer, in place:
    :func:`gather_blocks` then :func:`scatter_blocks` without the tensors in between (a tier's copies).

    Args:
        src, dst: two pools of the same layout (layers, shapes after the block dimension, dtypes),
            on any devices, e.g. a rank's cache and its host tier.
        src_ids, dst_ids: ``(n,)`` block ids each; ``dst_ids`` distinct.

    Raises:
        ValueError: pools of different layouts, id lists of different lengths, a repeated destination,
            or an id outside its pool. Nothing is written then.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"copy_blocks: {len(src_ids)} source blocks for {len(dst_ids)} destinations")
    if len(src) != len(dst) or any(s.shape[1:] != d.shape[1:] or s.dtype != d.dtype
                                   for sp, dp in zip(src, dst) for s, d in zip(sp, dp)):
        raise ValueError("copy_blocks: the two pools differ in layers, block shape or dtype")
    if not src or not src_ids:
        return
    src_index = _index(src_ids, src[0][0].shape[0], torch.device("cpu"))
    dst_index = _index(dst_ids, dst[0][0].shape[0], torch.device("cpu"), distinct=True)
    if src[0][0].device.type == "cpu" and dst[0][0].device.type == "cpu":  # numpy: no parallel regions
        src_rows, dst_rows = src_index.numpy(), dst_index.numpy()
        for src_pair, dst_pair in zip(src, dst):
            for s, d in zip(src_pair, dst_pair):
                _host_bytes(d)[dst_rows] = _host_bytes(s)[src_rows]
        return
    src_index, dst_index = src_index.to(src[0][0].device), dst_index.to(dst[0][0].device)
    for src_pair, dst_pair in zip(src, dst):
        for s, d in zip(src_pair, dst_pair):
            _raw(d).index_copy_(0, dst_index, _raw(s).index_select(0, src_index).to(d.device, non_blocking=True))
