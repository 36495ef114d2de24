"""One rank's host tier of the prefix cache: its slice of every evicted block, in host memory.

The coordinator decides which block goes to which host slot and back (coordinator/kv_host_tier.py);
the step plan carries the copies (``StepPlan.kv_swap_out`` / ``kv_swap_in``, tpserve/step.py) and
every rank runs them on its own cache before anything else of the step: each rank moves its own
KV heads (tensor parallelism: no exchange), each pipeline stage its own layers.

The slots mirror the device cache tensor for tensor: per layer ``(first, second)``, each
``(num_slots, block_size, heads, width)`` in the cache's dtype (8-bit codes stay codes: their scales
are per layer and fixed, worker/kv_quant.py), in CPU memory, page-locked when the cache is on CUDA
so that the copies are DMA transfers. A draft model's cache, indexed by the same block ids, has its
slots beside the target's. Copies go through worker/kv_block_io.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.kv_block_io import KVCaches, copy_blocks


class HostKVTier:
    """``num_slots`` host blocks shaped like this rank's cache, and the copies between them.

    Args:
        kv_caches: the device cache, per layer ``(first, second)``, each
            ``(num_blocks, block_size, heads, width)`` (a draft model's layers appended).
        num_slots: host blocks (the coordinator's ``HostTier.num_slots``).

    Raises:
        ValueError: ``num_slots < 1`` or no cache.
    """

    def __init__(self, kv_caches: KVCaches, num_slots: int) -> None:
        if num_slots < 1 or not kv_caches:
            raise ValueError(f"a host tier needs num_slots >= 1 and a cache, got {num_slots} slots, "
                             f"{len(kv_caches)} layers")
        pin = kv_caches[0][0].device.type == "cuda"
        self.num_slots = num_slots
        self.slots = [(self._like(first, num_slots, pin), self._like(second, num_slots, pin))
                      for first, second in kv_caches]  # per layer, (num_slots, block_size, heads, width) each

    @staticmethod
    def _like(cache: torch.Tensor, num_slots: int, pin: bool) -> torch.Tensor:
        return torch.zeros((num_slots, *cache.shape[1:]), dtype=cache.dtype, pin_memory=pin)

    @property
    def num_bytes(self) -> int:
        """Host memory the slots take, bytes."""
        return sum(t.numel() * t.element_size() for pair in self.slots for t in pair)

    def copy(self, kv_caches: KVCaches, swap_out: Sequence[tuple[int, int]],
             swap_in: Sequence[tuple[int, int]]) -> None:
        """Runs a plan's copies: every ``(device block, slot)`` of ``swap_out``, then every
        ``(slot, device block)`` of ``swap_in``.

        Raises:
            ValueError: a block or slot id out of range, or a slot (out) or block (in) named twice;
                nothing of that direction is written then.
        """
        if swap_out:
            blocks, slots = zip(*swap_out)
            copy_blocks(kv_caches, blocks, self.slots, slots)
        if swap_in:
            slots, blocks = zip(*swap_in)
            copy_blocks(self.slots, slots, kv_caches, blocks)
