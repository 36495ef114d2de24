"""The KV block allocator: which block ids of the paged cache are free, and who holds each.

The coordinator owns block ids; every worker rank has a pool of the same size, so an
id names the same slot range on every rank (each rank stores its own KV heads there).
Blocks carry reference counts so that a block may later be shared between sequences
(prefix caching); today every allocation holds one reference.

Pure Python, no torch: unit-tested without a device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


def check_pool_holds_a_full_sequence(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """Refuse a KV pool smaller than one ``max_model_len`` sequence (vLLM's start-up rule).

    Such a pool would refuse, or preempt forever, every request allowed to reach
    ``max_model_len``; the server refuses to start instead (docs/design.md, "KV cache sizing").

    Raises:
        ValueError: naming the pool's tokens, ``max_model_len`` and the flags that fix it.
    """
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks * block_size} tokens ({num_blocks} blocks of {block_size}) per rank, "
            f"less than one sequence of max_model_len={max_model_len}: raise --gpu-memory-utilization or "
            f"--kv-cache-memory-bytes (or --num-gpu-blocks-override), or lower --max-model-len"
        )


class BlockAllocator:
    """A free list of ``num_blocks`` block ids with reference counts.

    Args:
        num_blocks: blocks in the pool (the minimum over worker ranks).
        block_size: tokens per block.

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        # FIFO reuse: a freed block goes to the back, which keeps recently freed
        # blocks (and any content a future prefix cache may want) around longest.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds."""
        return len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` blocks are free right now."""
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Takes ``num_blocks`` free blocks, or None (and nothing) when too few are free."""
        if num_blocks > len(self._free):
            return None
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference to each block; a block with none left is free again.

        Raises:
            ValueError: a block that is already free (a double free is a bug upstream).
        """
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed while free")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def check_invariants(self, holders: Iterable[Iterable[int]]) -> None:
        """Asserts the allocator's bookkeeping against the block lists of every holder.

        Every block is either free (ref count 0, in the free list once) or held, and
        its ref count equals the number of holders that list it.

        Raises:
            AssertionError: the bookkeeping is inconsistent.
        """
        counts = [0] * self.num_blocks
        for block_ids in holders:
            for block_id in block_ids:
                counts[block_id] += 1
        assert counts == self._ref_counts, "ref counts differ from holders"
        free = sorted(self._free)
        assert free == sorted(set(free)), "a block is in the free list twice"
        assert free == [b for b in range(self.num_blocks) if counts[b] == 0], "free list differs from unheld blocks"
