"""Hybrid models' state slots, on the coordinator: who holds which slot of the workers' state pool.

A hybrid model's state layers keep a fixed-size state per sequence (worker/state_metadata.py) in
a pool of slots on every rank (worker/state_cache.py). The workers only read and write the slots
they are told; this module chooses them (pure Python, no torch), beside the KV block allocator:

* **live slots** ``0 .. num_live - 1`` (``num_live`` = ``--max-num-seqs``): one per running
  sequence, taken at admission and given back when it finishes, is aborted or is preempted. The
  scheduler admits no sequence without a free one (it waits, as for KV blocks).
* **checkpoint slots** ``num_live .. num_live + num_checkpoints - 1``: the state of a prompt saved
  at a block boundary, for prefix caching. A checkpoint is named by the chained hash of the
  block that ends at its boundary (coordinator/kv_cache_manager.py's ``extend_block_hashes``:
  tokens up to the boundary and the sequence's namespace, tenant and ``cache_salt``), so it is
  shared exactly as the KV blocks before it are. When every checkpoint slot holds a state, the
  least recently used one is overwritten (evicting it: a later hit then ends at an earlier
  boundary).

Saving a checkpoint is decided when the chunk that crosses the boundary is planned (the plan's
``state_checkpoints``); the workers run plans in order, so a later plan that restores it
(``restored_states``) finds it written. Within the plan being made it is *pending*: the workers
restore before they compute (tpserve/step.py, order 2a before 3), so a checkpoint saved by this
plan cannot be restored by it (it is not found until :meth:`StateSlots.end_plan`), nor
overwritten again by it. A slot overwritten in the plan that restores it is restored first.
"""

from __future__ import annotations

from collections import OrderedDict

from tpserve.model_config import ModelConfig


class StateSlots:
    """The state pool's live and checkpoint slots (module docstring).

    Args:
        num_live: live slots (``--max-num-seqs``), >= 1.
        num_checkpoints: checkpoint slots (0: no prefix caching for the state layers).

    Attributes:
        num_checkpoint_hits, num_checkpoint_queries: admissions that resumed from a checkpoint,
            and admissions of a hybrid model that looked for one (cumulative; the metrics'
            per-kind prefix-cache counters).

    Raises:
        ValueError: ``num_live < 1`` or ``num_checkpoints < 0``.
    """

    def __init__(self, num_live: int, num_checkpoints: int = 0) -> None:
        if num_live < 1 or num_checkpoints < 0:
            raise ValueError(f"state slots: num_live={num_live} must be >= 1 and num_checkpoints={num_checkpoints} >= 0")
        self.num_live = num_live
        self.num_checkpoints = num_checkpoints
        self._free_live = list(range(num_live - 1, -1, -1))  # pop() gives the lowest
        self._held: set[int] = set()
        self._free_checkpoints = list(range(num_live + num_checkpoints - 1, num_live - 1, -1))
        self._checkpoints: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, least recent first
        self._pending: set[bytes] = set()  # saved by the plan being made: not restorable before it runs
        self.num_checkpoint_hits = 0
        self.num_checkpoint_queries = 0

    @property
    def num_slots(self) -> int:
        """Slots of the workers' pool: live and checkpoint."""
        return self.num_live + self.num_checkpoints

    # -- live slots ----------------------------------------------------------------------

    @property
    def num_free_live(self) -> int:
        """Live slots no running sequence holds."""
        return len(self._free_live)

    def take_live(self) -> int | None:
        """A free live slot, now held; None when every one is held."""
        if not self._free_live:
            return None
        slot = self._free_live.pop()
        self._held.add(slot)
        return slot

    def free_live(self, slot: int) -> None:
        """Gives back a held live slot.

        Raises:
            ValueError: ``slot`` is not held.
        """
        if slot not in self._held:
            raise ValueError(f"live state slot {slot} is not held")
        self._held.remove(slot)
        self._free_live.append(slot)

    @property
    def held_live(self) -> frozenset[int]:
        """The live slots held now (the scheduler's invariants compare them with its running sequences)."""
        return frozenset(self._held)

    # -- checkpoints -----------------------------------------------------------------------

    def has_checkpoint(self, block_hash: bytes) -> bool:
        """Whether the state at the boundary after the block named ``block_hash`` is saved."""
        return block_hash in self._checkpoints and block_hash not in self._pending

    def resumable_blocks(self, block_hashes: list[bytes], num_cached_blocks: int) -> int:
        """The longest prefix of ``num_cached_blocks`` cached blocks whose end has a saved state
        (0: none; a hybrid's prefix hit is never longer than its state can resume from)."""
        for num_blocks in range(num_cached_blocks, 0, -1):
            if self.has_checkpoint(block_hashes[num_blocks - 1]):
                return num_blocks
        return 0

    def restore(self, block_hash: bytes) -> int:
        """The checkpoint slot saved after the block ``block_hash`` (now the most recently used), counted as a hit.

        Raises:
            KeyError: no such checkpoint.
        """
        self._checkpoints.move_to_end(block_hash)
        self.num_checkpoint_hits += 1
        return self._checkpoints[block_hash]

    def reserve_checkpoint(self, block_hash: bytes) -> int | None:
        """A slot to save the state after the block ``block_hash`` into, now naming it; None when it
        is saved already or there is no slot to save into. Overwrites the least recently used one
        when none is free (never one this plan saves)."""
        if block_hash in self._checkpoints or not self.num_checkpoints:
            return None
        if self._free_checkpoints:
            slot = self._free_checkpoints.pop()
        else:
            victim = next((h for h in self._checkpoints if h not in self._pending), None)
            if victim is None:
                return None
            slot = self._checkpoints.pop(victim)
        self._checkpoints[block_hash] = slot
        self._pending.add(block_hash)
        return slot

    def end_plan(self) -> None:
        """The plan is made: the checkpoints it saves are restorable by the plans after it."""
        self._pending.clear()

    @property
    def num_saved_checkpoints(self) -> int:
        """Checkpoint slots holding a saved state."""
        return len(self._checkpoints)

    def reset_checkpoints(self) -> None:
        """Forget every checkpoint (the worker group restarted: its pools are new and zeroed)."""
        self._checkpoints.clear()
        self._pending.clear()
        self._free_checkpoints = list(range(self.num_slots - 1, self.num_live - 1, -1))


def hybrid_state_slots(config: ModelConfig, max_num_seqs: int, num_state_slots: int) -> StateSlots | None:
    """The state slots of a pool of ``num_state_slots`` (the ranks' :meth:`worker.memory.cache_split`):
    ``max_num_seqs`` live slots, the rest checkpoints; None for an attention-only model.

    Raises:
        ValueError: a hybrid model whose ranks hold fewer than ``max_num_seqs`` slots.
    """
    if not config.state_layer_indices:
        return None
    if num_state_slots < max_num_seqs:
        raise ValueError(f"the ranks hold {num_state_slots} state slots, fewer than --max-num-seqs {max_num_seqs} "
                         "sequences' states; lower --max-num-seqs")
    return StateSlots(max_num_seqs, num_state_slots - max_num_seqs)
