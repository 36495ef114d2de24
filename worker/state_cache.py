"""One rank's state pool for a hybrid model's state layers, and each step's :class:`StateMetadata`.

Beside the paged KV cache of the attention layers (worker/kv_cache.py), a hybrid model's state
layers (worker/state_metadata.py) keep a fixed-size state per sequence. This module owns it:

* the pool: per state layer, one tensor per entry of its ``state_shapes()``, each
  ``(num_state_slots, *shape)`` in its ``state_dtypes()`` dtype, zeroed. Slots ``0 ..
  num_live - 1`` are the live slots (one per running sequence, ``--max-num-seqs`` of them); the
  rest are checkpoint slots (prefix caching). The coordinator chooses every slot number
  (coordinator/state_slots.py); this module only reads and writes them.
* the model's ``kv_caches`` list: per decoder layer, its ``(k_cache, v_cache)`` or its state
  tuple (:meth:`StateCache.layer_caches`);
* per step, before the forward pass: zero the live slot of every chunk that starts at position
  0, and copy each ``restored_states`` checkpoint into its sequence's live slot
  (:meth:`StateCache.prepare`); then the step's :class:`StateMetadata`, in the flat batch's row
  order (decodes first), with the plan's checkpoints (:meth:`StateCache.metadata`).

Attention-only models build none of this: the runner holds ``None`` and the step's
``AttentionMetadata.state`` stays None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch
from torch import nn

from tpserve.model_config import ModelConfig
from tpserve.step import ScheduledChunk, StepPlan
from worker.models.base import CausalLM
from worker.state_metadata import StateLayer, StateMetadata, copy_state_slots, zero_state_slots

#: State slots a runner allocates when its caller gives no count (tests; the server passes its
#: sizing: ``--max-num-seqs`` live slots plus the checkpoint slots, worker/memory.py).
DEFAULT_NUM_STATE_SLOTS = 256


def _specs(layer: nn.Module) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """A state layer's ``(per-slot shape, dtype)`` of each of its state tensors."""
    state_layer = cast(StateLayer, layer)
    return list(zip(state_layer.state_shapes(), state_layer.state_dtypes(), strict=True))


def bytes_per_state_slot(layers: Mapping[int, nn.Module]) -> int:
    """Bytes one slot takes on this rank: every state layer's tensors, at their dtypes."""
    total = 0
    for layer in layers.values():
        for shape, dtype in _specs(layer):
            numel = 1
            for size in shape:
                numel *= size
            total += numel * torch.empty((), dtype=dtype).element_size()
    return total


def check_state_layers(model: CausalLM, config: ModelConfig) -> dict[int, nn.Module]:
    """The model's state layers (``CausalLM.state_layers()``), checked against the config's ``layer_types``.

    Raises:
        ValueError: the family's state layers are not the layers its config names as state kinds.
    """
    layers = model.state_layers()
    if tuple(sorted(layers)) != config.state_layer_indices:
        raise ValueError(f"{config.architecture}: state layers {sorted(layers)} do not match config.json "
                         f"layer_types' state layers {list(config.state_layer_indices)}")
    return layers


class StateCache:
    """The state pool of one rank (see the module docstring).

    Args:
        layers: the model's state layers, ``{layer index: module}`` (``CausalLM.state_layers()``).
        num_slots: slots to allocate (live and checkpoint together), >= 1.
        device: where the pool lives.

    Raises:
        ValueError: ``num_slots < 1``.
    """

    def __init__(self, layers: Mapping[int, nn.Module], num_slots: int, device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError(f"num_state_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.device = device
        self.layer_indices = tuple(sorted(layers))
        self.states: dict[int, tuple[torch.Tensor, ...]] = {
            index: tuple(torch.zeros((num_slots, *shape), dtype=dtype, device=device)
                         for shape, dtype in _specs(layers[index]))
            for index in self.layer_indices
        }
        self.bytes_per_slot = bytes_per_state_slot(layers)

    def layer_caches(self, kv_caches: Sequence[tuple[torch.Tensor, ...]], num_layers: int) -> list[tuple[torch.Tensor, ...]]:
        """The model's per-layer cache list: state layers get their state tuple, the others, in order,
        the attention layers' ``(k_cache, v_cache)`` of ``kv_caches`` (one per attention layer)."""
        pairs = iter(kv_caches)
        merged = [self.states[i] if i in self.states else next(pairs) for i in range(num_layers)]
        if next(pairs, None) is not None:
            raise ValueError(f"{len(kv_caches)} KV caches for {num_layers - len(self.states)} attention layers")
        return merged

    def check_slots(self, step_id: int, slots: Sequence[int]) -> None:
        """Raises ``ValueError`` naming the step when a slot is outside the pool."""
        bad = [s for s in slots if not 0 <= s < self.num_slots]
        if bad:
            raise ValueError(f"step {step_id}: state slots {bad} outside [0, {self.num_slots})")

    def begin_step(self, plan: StepPlan, live_slots: Sequence[int], chunk_last_rows: Sequence[int]) -> StateMetadata:
        """Check the plan's live slots, :meth:`prepare` them, and return the step's :meth:`metadata`.

        Raises:
            ValueError: a slot outside the pool (naming the step).
        """
        self.check_slots(plan.step_id, live_slots)
        self.prepare(plan, live_slots)
        return self.metadata(plan, plan.scheduled, live_slots, chunk_last_rows)

    def prepare(self, plan: StepPlan, live_slots: Sequence[int]) -> None:
        """Before the forward pass: zero the live slot of each chunk at position 0, then restore
        each ``plan.restored_states`` checkpoint into its sequence's live slot.

        ``live_slots``: each scheduled chunk's sequence's live slot, in plan order.
        """
        fresh = [slot for chunk, slot in zip(plan.scheduled, live_slots) if chunk.start_position == 0]
        states = list(self.states.values())
        if fresh:
            zero_state_slots(states, torch.tensor(fresh, dtype=torch.int64, device=self.device))
        if plan.restored_states:
            slot_of = {chunk.seq_id: slot for chunk, slot in zip(plan.scheduled, live_slots)}
            pairs = [(src, slot_of[seq_id]) for seq_id, src in plan.restored_states if seq_id in slot_of]
            self.check_slots(plan.step_id, [src for src, _ in pairs])
            src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
            dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)
            copy_state_slots(states, src, dst)

    def metadata(self, plan: StepPlan, chunks: Sequence[ScheduledChunk], live_slots: Sequence[int],
                 chunk_last_rows: Sequence[int]) -> StateMetadata:
        """The step's :class:`StateMetadata`, sequences in the flat batch's row order.

        Args:
            plan: the step (its ``state_checkpoints``).
            chunks: the scheduled chunks in plan order (with proposals appended, if any).
            live_slots: each chunk's live slot, in plan order.
            chunk_last_rows: each chunk's last row in the flat batch (worker/step_inputs.py).
        """
        lens = [len(c.token_ids) for c in chunks]
        first_rows = [last - n + 1 for last, n in zip(chunk_last_rows, lens)]
        order = sorted(range(len(chunks)), key=first_rows.__getitem__)  # row order: decodes first
        marks: dict[int, list[tuple[int, int]]] = {}
        for seq_id, rows, slot in plan.state_checkpoints:
            marks.setdefault(seq_id, []).append((rows, slot))
        if marks:
            self.check_slots(plan.step_id, [slot for pairs in marks.values() for _, slot in pairs])
        checkpoints = tuple(tuple(sorted(marks.get(chunks[i].seq_id, ()))) for i in order)
        num_decodes = 0
        for k, i in enumerate(order):  # leading one-row sequences without a checkpoint
            if lens[i] != 1 or checkpoints[k]:
                break
            num_decodes += 1
        loc = [0]
        for i in order:
            loc.append(loc[-1] + lens[i])
        host_slots = tuple(live_slots[i] for i in order)
        return StateMetadata(torch.tensor(host_slots, dtype=torch.int64, device=self.device), tuple(loc),
                             num_decodes, checkpoints if marks else (), host_slots)
