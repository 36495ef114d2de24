"""The KV-cache manager: each sequence's block table, and prefix caching over the block pool.

The scheduler decides *what* runs; this module decides *which blocks* it runs in (vLLM
v1's ``KVCacheManager`` beside its ``BlockPool``):

    Scheduler ──asks──▶ KVCacheManager ──allocates, frees, caches──▶ BlockAllocator (the pool)
                         block hashes, prefix look-ups,          free lists, ref counts,
                         hit counts, block tables                the hash -> block index, eviction

Prefix caching: a full block is named by a chained hash of its tokens and every token
before it (:func:`extend_block_hashes`); block 0 chains from the sequence's namespace
(:mod:`coordinator.cache_isolation`: the caller's tenant and ``cache_salt``), so two
namespaces share no block. At admission a sequence takes references to the cached blocks
its tokens start with (:meth:`KVCacheManager.cached_prefix`, :meth:`~KVCacheManager.take_cached_prefix`);
as steps compute its blocks, the full ones enter the cache (:meth:`~KVCacheManager.cache_full_blocks`).

Hybrid models (with ``state_slots``, coordinator/state_slots.py): a prefix resumes only from a
saved state, so a hit is the longest cached prefix whose last block's end has a state checkpoint
(never the KV blocks alone); :meth:`~KVCacheManager.take_cached_prefix` returns the checkpoint slot
the sequence's live slot is restored from. Prompt chunks save the state at every block boundary
of the prompt they cross (:meth:`~KVCacheManager.state_checkpoints`), keyed by that block's hash:
the same chain and namespace as the KV blocks.
With a host tier (coordinator/kv_host_tier.py) the cache has two tiers: a cached block the pool
evicts is copied to a host slot, and admission continues the prefix past the device pool's
blocks through the host tier, each hit copied back into a fresh block
(:meth:`~KVCacheManager.take_cached_prefix`). A preempted sequence's full blocks stay cached
and so go the same way: preemption by swap (docs/design/scheduling.md, "The host tier").

Pure Python, no torch.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from typing import TYPE_CHECKING

from coordinator.block_allocator import BlockAllocator, num_blocks_for
from coordinator.state_slots import StateSlots
from coordinator.kv_host_tier import HostTier

if TYPE_CHECKING:
    from coordinator.kv_events import KvEventLog
    from coordinator.sequence import Sequence


def extend_block_hashes(seq: Sequence, block_size: int, num_tokens: int) -> list[bytes]:
    """Extends ``seq.block_hashes`` to every full block of its first ``num_tokens`` tokens.

    Block ``i``'s hash is ``SHA-256(hash of block i-1 || tokens of block i)``, the tokens
    as native int64 (the hashes never leave this process); block 0 chains from
    ``seq.cache_namespace`` (``b""`` by default), so two namespaces (tenants, cache salts)
    share no block hash at all. It names the block's tokens and every token before them,
    as vLLM's prefix cache does. SHA-256 rather than Python's ``hash`` because a collision
    would silently hand one prompt another prompt's K/V. The hashes depend only on the
    tokens, so they stay valid across preemptions.

    Returns:
        ``seq.block_hashes`` (``num_tokens // block_size`` entries at least).
    """
    hashes = seq.block_hashes
    for index in range(len(hashes), num_tokens // block_size):
        tokens = seq.token_ids(index * block_size, (index + 1) * block_size)
        hashes.append(next_block_hash(hashes[-1] if hashes else seq.cache_namespace, tokens))
    return hashes


def next_block_hash(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    """The hash of a full block of ``tokens`` after the block hashed ``parent`` (the namespace for block 0)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def prompt_block_hashes(token_ids: list[int], namespace: bytes, block_size: int, num_blocks: int) -> list[bytes]:
    """:func:`extend_block_hashes`' chain over the first ``num_blocks`` full blocks of ``token_ids``
    (a request not yet a sequence: a KV transfer's blocks, coordinator/kv_transfer/)."""
    hashes: list[bytes] = []
    for index in range(min(num_blocks, len(token_ids) // block_size)):
        hashes.append(next_block_hash(hashes[-1] if hashes else namespace,
                                      token_ids[index * block_size:(index + 1) * block_size]))
    return hashes


class KVCacheManager:
    """Gives sequences their KV blocks, sharing cached full blocks when prefix caching is on.

    Args:
        allocator: the worker group's block pool.
        enable_prefix_caching: share full blocks between sequences with the same tokens
            up to them (``--enable-prefix-caching``).
        state_slots: a hybrid model's state slots (their checkpoints bound every hit); None otherwise.
        host_tier: the prefix cache's second tier (``--kv-offloading-size``); None: none.

    Raises:
        ValueError: a host tier without prefix caching (it holds prefix-cache blocks), or of
            another block size.

    Attributes:
        prefix_cache_queries, prefix_cache_hits: tokens looked up in the prefix cache at
            admission, and how many of them were found, in either tier (cumulative).
        host_tier_hits: of ``prefix_cache_hits``, the tokens copied back from the host tier.
    """

    def __init__(self, allocator: BlockAllocator, enable_prefix_caching: bool = False,
                 *, state_slots: StateSlots | None = None, host_tier: HostTier | None = None) -> None:
        if host_tier is not None and not enable_prefix_caching:
            raise ValueError("the KV host tier (--kv-offloading-size) holds prefix-cache blocks: it needs "
                             "--enable-prefix-caching")
        if host_tier is not None and host_tier.block_size != allocator.block_size:
            raise ValueError(f"host tier block_size {host_tier.block_size} != the pool's {allocator.block_size}")
        self.allocator = allocator
        self.state = state_slots
        self.block_size = allocator.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.host_tier = host_tier
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.host_tier_hits = 0
        self._attach_tier()

    def _attach_tier(self) -> None:
        """Sends the pool's evictions to the host tier, and says so on the KV events."""
        tier = self.host_tier
        if tier is None:
            return
        self.allocator.on_evict = lambda block_id, block_hash, namespace: tier.store(block_id, block_hash, namespace)
        tier.listener = self.allocator.listener
        if tier.listener is not None:
            tier.listener.device_medium = "GPU"

    def attach_listener(self, listener: KvEventLog) -> None:
        """Tells ``listener`` of every block entering or leaving either tier."""
        self.allocator.listener = listener
        self._attach_tier()

    # -- admission ---------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks ``seq``'s tokens start with, leaving at least its last token to compute
        (its logits are needed). Nothing changes; nothing for a sequence that asks for prompt
        logprobs (every prompt position needs its logits) or with prefix caching off."""
        if not self.enable_prefix_caching or seq.sampling.prompt_logprobs is not None:
            return []
        num_full = (seq.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(seq, self.block_size, num_full * self.block_size)
        cached = self.allocator.lookup(hashes[:num_full])
        if self.state is not None and cached:  # as far as a saved state reaches
            del cached[self.state.resumable_blocks(hashes, len(cached)):]
        return cached

    def num_blocks_to_admit(self, seq: Sequence, cached: list[int]) -> int:
        """Free blocks that admitting ``seq`` with the cached prefix ``cached`` uses up: its
        uncached blocks, plus the cached ones nobody holds (they count as free blocks)."""
        return num_blocks_for(seq.num_tokens, self.block_size) - len(cached) + self.allocator.num_unheld(cached)

    def take_cached_prefix(self, seq: Sequence, cached: list[int]) -> int | None:
        """Makes ``cached`` the start of ``seq``'s (empty) block table, as computed tokens, and counts the look-up.

        With a host tier the prefix goes on past ``cached``, block by block, while the next block is
        in either tier: each host-tier hit gets a fresh block (ordered copied in before the plan's
        forward) and is cached there at once. Each such block uses up at most one free block, as
        :meth:`num_blocks_to_admit` counted it, so admission never takes more than it checked.
        (Hybrid models have no host tier: the leader refuses the combination.)

        Returns:
            Hybrid models: the checkpoint slot to restore ``seq``'s state from (None: no hit).
        """
        self.allocator.acquire(cached)
        seq.block_ids = list(cached)
        if self.host_tier is not None:
            self._continue_from_tier(seq)
        num_cached_tokens = len(seq.block_ids) * self.block_size
        restore = None
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_cached_tokens
            if self.state is not None:
                self.state.num_checkpoint_queries += 1
                restore = self.state.restore(seq.block_hashes[len(cached) - 1]) if cached else None
        if seq.num_cached_prompt_tokens is None:
            # a continuation's given tokens count as prompt (usage): a hit may cover them too
            seq.num_cached_prompt_tokens = min(num_cached_tokens, seq.num_usage_prompt_tokens)
        seq.admitted_s.append(time.monotonic())  # once per admission, not per step: the request's timings
        seq.num_computed_tokens = num_cached_tokens
        return restore

    def state_checkpoints(self, seq: Sequence, start: int, num_new: int) -> list[tuple[int, int, int]]:
        """Hybrid models: ``(seq_id, rows, slot)`` for each prompt block boundary in ``(start, start + num_new]``
        whose state is not saved yet: after ``rows`` rows of the chunk, the workers save it into ``slot``.
        Empty without prefix caching or state slots, and for chunks past the prompt."""
        state, size = self.state, self.block_size
        end = min(start + num_new, seq.num_prompt_tokens)
        if state is None or not self.enable_prefix_caching or end < (start // size + 1) * size:
            return []
        hashes = extend_block_hashes(seq, size, end)
        marks = []
        # The last boundaries first: when the slots run short, the longest hits are the ones kept.
        for boundary in reversed(range((start // size + 1) * size, end + 1, size)):
            slot = state.reserve_checkpoint(hashes[boundary // size - 1])
            if slot is not None:
                marks.append((seq.seq_id, boundary - start, slot))
        return marks[::-1]  # in increasing rows

    def _continue_from_tier(self, seq: Sequence) -> None:
        """Extends ``seq``'s cached prefix (its block table) through either tier (take_cached_prefix)."""
        tier, allocator, block_size = self.host_tier, self.allocator, self.block_size
        assert tier is not None
        if seq.sampling.prompt_logprobs is not None:
            return
        num_full = (seq.num_tokens - 1) // block_size
        hashes = extend_block_hashes(seq, block_size, num_full * block_size)
        namespace = seq.cache_namespace
        while len(seq.block_ids) < num_full:
            index = len(seq.block_ids)
            block_hash = hashes[index]
            on_device = allocator.lookup((block_hash,))
            if on_device:  # after a block the pool had evicted: a later one it still holds
                allocator.acquire(on_device)
                seq.block_ids.append(on_device[0])
                continue
            slot = tier.lookup(block_hash, namespace)
            if slot is None:
                return
            tier.pin(slot)  # the allocation may evict a device block into the tier: not into this slot
            fresh = allocator.allocate(1)
            if fresh is None:
                return
            tier.load(slot, fresh[0])
            listener = allocator.listener
            tokens = seq.token_ids(index * block_size, (index + 1) * block_size) if listener else ()
            allocator.cache(fresh[0], block_hash, tokens, hashes[index - 1] if index else None, namespace)
            seq.block_ids.append(fresh[0])
            self.host_tier_hits += block_size

    def take_copy_orders(self) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """The host tier's copies for the plan being sent (:meth:`HostTier.take_orders`); none without a tier."""
        return ((), ()) if self.host_tier is None else self.host_tier.take_orders()

    def flush(self) -> int:
        """Drops every cached block nobody holds from the device pool, and the whole host tier (an operator's
        FlushCache). Returns how many device blocks were dropped."""
        if self.host_tier is not None:
            self.host_tier.clear()
        return self.allocator.evict_cached()

    # -- growth and release ------------------------------------------------------------

    def grow(self, seq: Sequence, num_new: int) -> list[int] | None:
        """Allocates the blocks ``seq`` needs to hold ``num_new`` more tokens; returns them
        (``[]``: none needed), or None (and nothing) when too few are free."""
        needed = num_blocks_for(seq.num_computed_tokens + num_new, self.block_size) - len(seq.block_ids)
        if needed <= 0:
            return []
        block_ids = self.allocator.allocate(needed)
        if block_ids is not None:
            seq.block_ids.extend(block_ids)
        return block_ids

    def trim(self, seq: Sequence, num_blocks: int) -> None:
        """Frees ``seq``'s blocks after its first ``num_blocks`` (reserved for rejected proposals)."""
        self.allocator.free(reversed(seq.block_ids[num_blocks:]))
        del seq.block_ids[num_blocks:]

    def free(self, seq: Sequence) -> None:
        """Drops ``seq``'s whole block table; its cached blocks stay cached, last ones evicted first."""
        self.allocator.free(reversed(seq.block_ids))
        seq.block_ids = []

    def reset(self) -> None:
        """A new, empty pool of the same size (the worker group restarted: cached prefixes named
        K/V that no longer exists); the KV-event listener is kept and told."""
        listener = self.allocator.listener
        self.allocator = BlockAllocator(self.allocator.num_blocks, self.block_size)
        if self.state is not None:  # the new ranks' state pools are zeroed: no checkpoint survives
            self.state.reset_checkpoints()
        self.allocator.listener = listener
        if self.host_tier is not None:  # the new ranks' host slots are empty too (the listener hears cleared)
            self.host_tier.clear(notify=False)
            self._attach_tier()
        if listener is not None:
            listener.cleared()

    # -- caching computed blocks -------------------------------------------------------

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int, start: int | None = None) -> None:
        """Records in the prefix cache the blocks of ``seq`` that became full once its first
        ``num_computed_tokens`` tokens are computed, from position ``start`` on (None:
        ``seq.num_computed_tokens``; call before raising it). Async scheduling passes the
        applied chunk's start: the sequence's count ran ahead when later steps were planned."""
        if not self.enable_prefix_caching:
            return
        first = (seq.num_computed_tokens if start is None else start) // self.block_size
        last = num_computed_tokens // self.block_size
        if last <= first:
            return
        hashes = extend_block_hashes(seq, self.block_size, num_computed_tokens)
        listener = self.allocator.listener
        for index in range(first, last):
            # Tokens and parent go to a KV-event listener only (coordinator/kv_events.py).
            tokens = seq.token_ids(index * self.block_size, (index + 1) * self.block_size) if listener else ()
            self.allocator.cache(seq.block_ids[index], hashes[index], tokens, hashes[index - 1] if index else None,
                                 seq.cache_namespace)
