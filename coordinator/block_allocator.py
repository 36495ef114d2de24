"""The KV block allocator: which block ids of the paged cache are free, and who holds each.

The coordinator owns block ids; every worker rank has a pool of the same size, so an
id names the same slot range on every rank (each rank stores its own KV heads there).
Blocks carry reference counts because full blocks are shared between sequences
(automatic prefix caching, as in vLLM): a full block is named by a hash of its
tokens chained with every token before it (:mod:`coordinator.kv_cache_manager`), and a
sequence whose prompt starts with cached blocks takes references to them instead of
computing them again. A cached block is never written again; when nobody holds it,
it stays cached until the pool needs it (least recently freed first).

Pure Python, no torch: unit-tested without a device.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.kv_events import KvEventLog


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


def check_pool_holds_a_full_sequence(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """Refuse a KV pool smaller than one ``max_model_len`` sequence (vLLM's start-up rule).

    Such a pool would refuse, or preempt forever, every request allowed to reach
    ``max_model_len``; the server refuses to start instead (docs/design/scheduling.md, "KV cache sizing").

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
    """The block pool: free blocks, reference counts and the prefix cache's index.

    A block is in exactly one state:

    - **free, uncached**: nobody holds it and its contents mean nothing;
    - **free, cached**: nobody holds it, but it holds the K/V of a full block whose
      hash is known (``cache``); a sequence whose prompt starts with that block can
      take it back (``acquire``). These are evicted least-recently-freed first, and
      only when no uncached free block is left;
    - **held**: ``ref_count`` sequences list it in their block tables. A held block
      with a hash is full and never written again, so it may be shared; a held block
      without one belongs to exactly one sequence.

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
        # FIFO reuse of uncached blocks: a freed block goes to the back.
        self._free: deque[int] = deque(range(num_blocks))
        # Cached blocks nobody holds, least recently freed first (the eviction order).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._block_of_hash: dict[bytes, int] = {}
        self._hash_of_block: dict[int, bytes] = {}
        self.num_evictions = 0
        #: Told of every block that enters or leaves the prefix cache (coordinator/kv_events.py).
        self.listener: KvEventLog | None = None
        #: Called ``(block_id, block_hash, namespace)`` with each cached block evicted for reuse, before
        #: anything can write it: the host tier keeps a copy (coordinator/kv_host_tier.py). None: off.
        self.on_evict: Callable[[int, bytes, bytes], None] | None = None
        self._namespace_of_block: dict[int, bytes] = {}  # cached blocks' namespaces, kept only for on_evict

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds (uncached, or cached and evictable)."""
        return len(self._free) + len(self._evictable)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` blocks are free right now."""
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Takes ``num_blocks`` free blocks, or None (and nothing) when too few are free.

        Uncached blocks go first; then cached ones nobody holds are evicted, least
        recently freed first (their hashes leave the cache).
        """
        if num_blocks > self.num_free_blocks:
            return None
        block_ids = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block_hash = self._hash_of_block.pop(block_id)
                del self._block_of_hash[block_hash]
                self.num_evictions += 1
                if self.listener is not None:
                    self.listener.removed(block_hash)
                if self.on_evict is not None:
                    self.on_evict(block_id, block_hash, self._namespace_of_block.pop(block_id, b""))
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference to each block; a block with none left is free again.

        A cached block keeps its contents and hash until it is evicted. Pass a block
        table in reverse order so that a sequence's last blocks, the least likely to
        be shared, are evicted before its first ones.

        Raises:
            ValueError: a block that is already free (a double free is a bug upstream).
        """
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed while free")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if block_id in self._hash_of_block:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    # -- the prefix cache ------------------------------------------------------------

    def evict_cached(self) -> int:
        """Drops every cached block nobody holds from the prefix cache (they become plain
        free blocks); held blocks keep their hashes. Returns how many were dropped."""
        num_dropped = len(self._evictable)
        for block_id in self._evictable:
            block_hash = self._hash_of_block.pop(block_id)
            del self._block_of_hash[block_hash]
            self._namespace_of_block.pop(block_id, None)
            self._free.append(block_id)
            if self.listener is not None:
                self.listener.removed(block_hash)
        self._evictable.clear()
        return num_dropped


    def lookup(self, block_hashes: Iterable[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``block_hashes`` (nothing changes).

        Args:
            block_hashes: chained hashes of a sequence's full blocks, first block first
                (:func:`coordinator.kv_cache_manager.extend_block_hashes`).
        """
        block_ids = []
        for block_hash in block_hashes:
            block_id = self._block_of_hash.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def num_unheld(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` nobody holds (taking them uses up free blocks)."""
        return sum(1 for block_id in block_ids if self._ref_counts[block_id] == 0)

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Takes one more reference to each cached block (a prefix cache hit).

        Raises:
            ValueError: a block that is not cached.
        """
        for block_id in block_ids:
            if block_id not in self._hash_of_block:
                raise ValueError(f"block {block_id} acquired but not cached")
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def cache(self, block_id: int, block_hash: bytes, token_ids: Sequence[int] = (),
              parent_hash: bytes | None = None, namespace: bytes = b"") -> None:
        """Records that held block ``block_id`` is full and holds the K/V of ``block_hash``.

        From now on the block is never written again. When another block already holds
        that hash (two sequences computed the same prefix at once), nothing changes: the
        block stays its sequence's own, uncached, and is freed as such. ``token_ids``,
        ``parent_hash`` (the block before it in its sequence) and ``namespace`` only go to
        the ``listener`` (and ``namespace`` to ``on_evict``).

        Raises:
            ValueError: the block is free or already cached under another hash.
        """
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} cached while free")
        known = self._hash_of_block.get(block_id)
        if known is not None:
            if known != block_hash:
                raise ValueError(f"block {block_id} is already cached under another hash")
            return
        if block_hash in self._block_of_hash:
            return
        self._block_of_hash[block_hash] = block_id
        self._hash_of_block[block_id] = block_hash
        if self.on_evict is not None and namespace:
            self._namespace_of_block[block_id] = namespace
        if self.listener is not None:
            self.listener.stored(block_hash, token_ids, parent_hash, namespace)

    def is_cached(self, block_id: int) -> bool:
        """Whether the block holds a cached full block (and so must never be written)."""
        return block_id in self._hash_of_block

    def ref_count(self, block_id: int) -> int:
        """Sequences that hold the block."""
        return self._ref_counts[block_id]

    def check_invariants(self, holders: Iterable[Iterable[int]]) -> None:
        """Asserts the allocator's bookkeeping against the block lists of every holder.

        Every block is either free (ref count 0, in exactly one of the free lists) or
        held, never both; its ref count equals the number of holders that list it; a
        block listed by two holders is cached; the cached free blocks are exactly the
        free blocks with a hash; hash and block maps are each other's inverse.

        Raises:
            AssertionError: the bookkeeping is inconsistent.
        """
        counts = [0] * self.num_blocks
        for block_ids in holders:
            for block_id in block_ids:
                counts[block_id] += 1
        assert counts == self._ref_counts, "ref counts differ from holders"
        free = sorted(self._free)
        evictable = sorted(self._evictable)
        assert free == sorted(set(free)), "a block is in the free list twice"
        assert not set(free) & set(evictable), "a block is both uncached-free and cached-free"
        assert sorted(free + evictable) == [b for b in range(self.num_blocks) if counts[b] == 0], \
            "free lists differ from unheld blocks (a block both free and held, or leaked)"
        assert all(b not in self._hash_of_block for b in free), "an uncached free block has a hash"
        assert all(b in self._hash_of_block for b in evictable), "a cached free block has no hash"
        assert all(b in self._hash_of_block for b in range(self.num_blocks) if counts[b] > 1), \
            "a block shared by several sequences is not cached"
        assert {h: b for b, h in self._hash_of_block.items()} == self._block_of_hash, "hash maps disagree"
        assert set(self._namespace_of_block) <= set(self._hash_of_block), "an uncached block keeps a namespace"
