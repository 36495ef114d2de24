"""The prefix cache's second tier: a larger pool of host slots that device blocks go to when evicted.

vLLM's KV offloading (``--kv-offloading-size``) and SGLang's HiCache keep, beside the device
pool, a host-memory pool of blocks: a cached block the device pool evicts is copied there
instead of being lost, and a prompt whose prefix is found there gets it copied back into a
fresh device block instead of recomputing it. The same here, with the usual split of roles:

    coordinator (this module, no torch)             every worker rank (worker/kv_host_tier.py)
    which block hash is in which host slot,    ──▶  host tensors of ``num_slots`` blocks of its
    least recently used first, its namespace;       own KV slice; before a step's forward it runs
    the copy orders of the plan being built         the plan's copies: device -> slot, then
    (StepPlan.kv_swap_out / kv_swap_in)             slot -> device (tpserve/step.py)

A slot is named by the block's chained hash (:func:`coordinator.kv_cache_manager.extend_block_hashes`),
which starts from the request's namespace (tenant, ``cache_salt``, LoRA adapter:
coordinator/cache_isolation.py); the slot also records that namespace and a look-up must name
it again, so no slot is ever served to another namespace even if a chain were to collide.

Policy (docs/design/scheduling.md, "The host tier"):

- **write on eviction** (SGLang's write-back): a device block goes to the tier only when the
  device pool evicts it, so a working set that fits the device pool costs no copy at all;
- **least recently used**: a slot is touched when stored or read; a full tier drops its least
  recently used slot, except the ones the plan being built copies to or from (their copies have
  not run yet, and one plan never names a slot twice as a destination);
- a block read back stays in its slot too (it lives in both tiers until one evicts it).

Pure Python, no torch.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.kv_events import KvEventLog


GIB = 1 << 30
#: Most host blocks (the worker protocol's uint32 block ids).
MAX_HOST_BLOCKS = 2**31 - 1


def num_host_slots(kv_offloading_size: float | None, num_cpu_blocks_override: int | None,
                   bytes_per_block: Sequence[int]) -> int:
    """Host-tier blocks per rank: the override, else ``kv_offloading_size`` GiB shared out over the ranks
    (vLLM's ``--kv-offloading-size`` is the sum over the group), in blocks of the largest rank's size.

    Args:
        kv_offloading_size: ``--kv-offloading-size``, GiB; None: no tier (unless overridden).
        num_cpu_blocks_override: ``--num-cpu-blocks-override``; None: from the size.
        bytes_per_block: one KV block's bytes on each rank (WorkerStatus.kv_bytes_per_block).

    Returns:
        The block count, 0 when neither is set.

    Raises:
        ValueError: a size that holds no block per rank, or more than :data:`MAX_HOST_BLOCKS` blocks.
    """
    if num_cpu_blocks_override is not None:
        num = num_cpu_blocks_override
    elif kv_offloading_size is None:
        return 0
    else:
        largest = max(bytes_per_block)
        num = int(kv_offloading_size * GIB / len(bytes_per_block)) // largest
        if num < 1:
            raise ValueError(f"--kv-offloading-size {kv_offloading_size:g} GiB over {len(bytes_per_block)} ranks "
                             f"holds no KV block of {largest} bytes: raise it")
    if num > MAX_HOST_BLOCKS:
        raise ValueError(f"the host tier would have {num} blocks, more than {MAX_HOST_BLOCKS}: lower "
                         "--kv-offloading-size or --num-cpu-blocks-override")
    return num


class HostTier:
    """Host slots holding evicted prefix-cache blocks, and the copy orders for the next plan.

    Args:
        num_slots: blocks the host tier holds (the minimum over ranks).
        block_size: tokens per block.

    Raises:
        ValueError: ``num_slots`` or ``block_size`` not positive.

    Attributes:
        num_hits: blocks found here and copied back to the device (cumulative).
        num_stores: blocks copied here from the device (cumulative).
        num_evictions: slots dropped to make room (cumulative).
        listener: told of every block that enters or leaves the tier (coordinator/kv_events.py).
    """

    def __init__(self, num_slots: int, block_size: int) -> None:
        if num_slots <= 0 or block_size <= 0:
            raise ValueError(f"num_slots ({num_slots}) and block_size ({block_size}) must be positive")
        self.num_slots = num_slots
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_slots))
        self._slot_of_hash: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._hash_of_slot: dict[int, bytes] = {}
        self._namespace_of_slot: dict[int, bytes] = {}
        self._swap_out: list[tuple[int, int]] = []  # (device block, slot), in order
        self._swap_in: list[tuple[int, int]] = []  # (slot, device block), in order
        self._busy: set[int] = set()  # slots the plan being built copies to or from: not reused within it
        self.num_hits = 0
        self.num_stores = 0
        self.num_evictions = 0
        self.listener: KvEventLog | None = None

    @property
    def num_used_slots(self) -> int:
        """Slots holding a block."""
        return len(self._hash_of_slot)

    def lookup(self, block_hash: bytes, namespace: bytes) -> int | None:
        """The slot holding ``block_hash`` of ``namespace``, or None (nothing changes)."""
        slot = self._slot_of_hash.get(block_hash)
        if slot is None or self._namespace_of_slot[slot] != namespace:
            return None
        return slot

    def store(self, block_id: int, block_hash: bytes, namespace: bytes) -> None:
        """Device block ``block_id``, about to be reused, holds ``block_hash``: orders its copy into a slot.

        A hash already here is only touched (its slot holds the same K/V). With no free slot the
        least recently used one the plan being built does not copy to or from is dropped; when
        every slot is (a tier smaller than one plan's copies), the block is not kept.
        """
        slot = self._slot_of_hash.get(block_hash)
        if slot is not None:
            self._slot_of_hash.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._slot_of_hash[block_hash] = slot
        self._hash_of_slot[slot] = block_hash
        self._namespace_of_slot[slot] = namespace
        self._swap_out.append((block_id, slot))
        self._busy.add(slot)
        self.num_stores += 1
        if self.listener is not None:
            self.listener.stored(block_hash, (), None, namespace, medium="CPU")

    def pin(self, slot: int) -> None:
        """Keeps ``slot`` (a look-up's answer) for the plan being built: call before allocating the device
        block it is loaded into, whose eviction may store another block in the tier."""
        self._busy.add(slot)

    def load(self, slot: int, block_id: int) -> None:
        """Orders slot ``slot``'s copy into device block ``block_id`` (a hit); the slot keeps its block.

        Raises:
            ValueError: an empty slot.
        """
        block_hash = self._hash_of_slot.get(slot)
        if block_hash is None:
            raise ValueError(f"host slot {slot} loaded but empty")
        self._slot_of_hash.move_to_end(block_hash)
        self._swap_in.append((slot, block_id))
        self._busy.add(slot)
        self.num_hits += 1

    def take_orders(self) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """The copies ordered since the last call, for the plan being sent: ``(swap_out, swap_in)``,
        ``(device block, slot)`` and ``(slot, device block)`` pairs in order; their slots are then
        ordinary (later plans run after this one's copies)."""
        orders = tuple(self._swap_out), tuple(self._swap_in)
        self._swap_out.clear()
        self._swap_in.clear()
        self._busy.clear()
        return orders

    def put_back_orders(self, swap_out: tuple[tuple[int, int], ...], swap_in: tuple[tuple[int, int], ...]) -> None:
        """Orders of a plan that will not be sent go ahead of those of the next one."""
        self._swap_out[:0] = swap_out
        self._swap_in[:0] = swap_in
        self._busy.update(slot for slot, _ in swap_in)
        self._busy.update(slot for _, slot in swap_out)

    def clear(self, notify: bool = True) -> None:
        """Forgets every slot's block and any order not taken yet (an operator's flush, or ranks restarted with
        empty slots; between plans); nothing is copied. The counters stay. ``notify``: tell the listener."""
        if notify and self.listener is not None:
            for block_hash in self._slot_of_hash:
                self.listener.removed(block_hash, medium="CPU")
        self._free = deque(range(self.num_slots))
        self.take_orders()
        self._slot_of_hash.clear()
        self._hash_of_slot.clear()
        self._namespace_of_slot.clear()

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.popleft()
        # The least recently used slot not read by the plan being built.
        block_hash = next((h for h, s in self._slot_of_hash.items() if s not in self._busy), None)
        if block_hash is None:
            return None
        slot = self._slot_of_hash.pop(block_hash)
        del self._hash_of_slot[slot]
        del self._namespace_of_slot[slot]
        self.num_evictions += 1
        if self.listener is not None:
            self.listener.removed(block_hash, medium="CPU")
        return slot

    def check_invariants(self) -> None:
        """Asserts that every slot is free or holds one block, and the maps are each other's inverse.

        Raises:
            AssertionError: the bookkeeping is inconsistent.
        """
        assert {s: h for h, s in self._slot_of_hash.items()} == self._hash_of_slot, "slot maps disagree"
        assert set(self._namespace_of_slot) == set(self._hash_of_slot), "a slot without a namespace"
        assert not set(self._free) & set(self._hash_of_slot), "a slot both free and used"
        assert len(self._free) + len(self._hash_of_slot) == self.num_slots, "a slot leaked"
