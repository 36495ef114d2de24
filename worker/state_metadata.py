"""The contract between the state layers of hybrid models and the rest of the worker.

Hybrid families (Qwen3-Next / Qwen3.5: Gated DeltaNet; Granite 4 / Nemotron-H: Mamba-2;
LFM2: short convolutions) put layers with a fixed-size per-sequence *state* beside attention
layers. Attention layers keep their paged KV cache; a state layer keeps, per sequence, a
convolution window and (for linear attention and SSMs) a recurrent matrix per head.

State pool. Every state layer owns a tuple of tensors, each ``(num_state_slots, *per_slot_shape)``,
allocated by the runner from the layer's :meth:`StateLayer.state_shapes` and passed to it where an
attention layer receives its ``(k_cache, v_cache)`` (the model's ``kv_caches`` list holds, per
layer, either a KV pair or a state tuple). A slot is one sequence's state (a *live* slot) or a
state saved at a prompt block boundary for prefix caching (a *checkpoint* slot); both live in the
same pool, so restoring a prefix or forking ``n > 1`` samples is a copy of one slot into another
(:func:`copy_state_slots`). The coordinator (torch-free) chooses every slot number; the worker
only reads and writes the slots it is told.

The runner zeroes a live slot before the chunk that starts a sequence at position 0 (or copies a
checkpoint into it on a prefix hit), so a layer always continues from the slot's state.

Where the pieces are: a family lists its state layers with ``CausalLM.state_layers()``
(worker/models/base.py); the runner's pool and each step's :class:`StateMetadata` are
worker/state_cache.py's (``StateCache.begin_step``), attached as ``AttentionMetadata.state``
(worker/attention.py; None for attention-only models); the model's ``kv_caches`` list holds, at
each state layer's index, that layer's state tuple. The coordinator's slots and checkpoints:
coordinator/state_slots.py; the plan's fields: ``NewSequence.state_slot``,
``StepPlan.restored_states`` and ``StepPlan.state_checkpoints`` (tpserve/step.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class StateMetadata:
    """What the state layers need about one step, built once per step and shared by every state layer.

    Sequences are in row order of the flat batch (the decode group first, then the prefill chunks,
    as in :class:`worker.attention.AttentionMetadata`).

    Attributes:
        slots: ``(B,) int64`` on the device: each sequence's live state slot.
        query_start_loc: ``B + 1`` row offsets (Python ints): sequence ``i`` owns rows
            ``[query_start_loc[i], query_start_loc[i + 1])``.
        num_decodes: the first ``num_decodes`` sequences have exactly one row each and are advanced
            together by the recurrent step (rows ``[0, num_decodes)``).
        checkpoints: per sequence, ``(rows, slot)`` pairs in increasing ``rows``: after the
            sequence's first ``rows`` rows of this step, copy its state into checkpoint ``slot``
            (a prompt block boundary, for prefix caching). Empty tuples for most sequences.
            A sequence with checkpoints is never in the decode group.
        host_slots: ``slots`` as Python ints (``B``), so a layer indexes one sequence's slot
            (``state[k][host_slots[i]]``, a view) without a device-to-host copy.

    Built by worker/state_cache.py's :meth:`~worker.state_cache.StateCache.metadata` and
    attached to :class:`worker.attention.AttentionMetadata` as ``state`` (None for
    attention-only models).
    """

    slots: torch.Tensor
    query_start_loc: tuple[int, ...]
    num_decodes: int
    checkpoints: tuple[tuple[tuple[int, int], ...], ...] = ()
    host_slots: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        """``B``: sequences in the step."""
        return len(self.query_start_loc) - 1

    def segments(self, index: int) -> list[tuple[int, int, int | None]]:
        """Sequence ``index``'s rows split at its checkpoints: ``[(start_row, end_row, save_slot or None)]``.

        A layer runs its chunked (parallel) form over each segment in turn, carrying the state,
        and copies the state into ``save_slot`` after a segment that ends on a checkpoint.
        """
        start, end = self.query_start_loc[index], self.query_start_loc[index + 1]
        marks = self.checkpoints[index] if index < len(self.checkpoints) else ()
        out: list[tuple[int, int, int | None]] = []
        at = start
        for rows, slot in marks:
            out.append((at, start + rows, slot))
            at = start + rows
        if at < end or not out:
            out.append((at, end, None))
        return out


class StateLayer(Protocol):
    """A layer with a per-sequence state (implemented by worker/layers/ modules and family files).

    ``forward(x (T, hidden), state: tuple[Tensor, ...], meta: StateMetadata) -> (T, hidden)``:
    reads and updates ``state[k][meta.slots[i]]`` for each sequence ``i``; rows of different
    sequences never mix. The chunked (prefill) form and the recurrent (decode) step must give the
    same outputs and states (up to float rounding).
    """

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """This rank's per-slot shapes of the layer's state tensors (heads and channels already split by tp)."""
        ...

    def state_dtypes(self) -> tuple[torch.dtype, ...]:
        """Dtype of each state tensor (recurrent states usually float32 whatever the activations)."""
        ...


def copy_state_slots(states: Sequence[tuple[torch.Tensor, ...]], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy slots ``src (n,) int64`` onto slots ``dst (n,) int64`` in every state layer's tensors.

    Used for a prefix hit (checkpoint -> live), a checkpoint save done by the runner, and forking
    a sequence's state for ``n > 1`` samples.
    """
    for layer_state in states:
        for tensor in layer_state:
            tensor.index_copy_(0, dst, tensor.index_select(0, src))


def zero_state_slots(states: Sequence[tuple[torch.Tensor, ...]], slots: torch.Tensor) -> None:
    """Reset slots ``slots (n,) int64`` of every state layer to zeros (a sequence starting at position 0)."""
    for layer_state in states:
        for tensor in layer_state:
            tensor.index_fill_(0, slots, 0)
