"""Batched low-rank adapters (LoRA, Hu et al. 2021, arXiv:2106.09685) on tensor-parallel linear layers.

An adapter adds ``scaling * (x @ A.T) @ B.T`` to a layer's ``y = x @ W.T + b``, with
``A (r, in)``, ``B (out, r)`` and ``scaling = lora_alpha / r`` (rsLoRA, Kalajdzievski 2023,
arXiv:2312.03732: ``lora_alpha / sqrt(r)``); peft's ``LoraLayer`` computes the same sum.

One step serves rows under different adapters and rows under none (Punica, Chen et al.
2023, arXiv:2310.18547; S-LoRA, arXiv:2311.03285): the base GEMM runs once over every
row, then, for each adapter slot present in the step, its rows' low-rank path
``(x[rows] @ A_s.T) @ B_s.T`` is added to ``y[rows]``. A step with no adapter row does
no LoRA work (:attr:`LoRAStep.groups` is empty: one branch per layer).

Slots: a fixed pool of ``max_loras`` resident adapters sized at start-up, each padded to
``max_lora_rank`` (zero rows of A and zero columns of B add nothing). Slot 0 is the base
model; adapter slots are ``1 .. max_loras``, stored at index ``slot - 1``.

Tensor parallelism (the Megatron split of the layer adapted, worker/layers/linear.py):

* column-parallel (``qkv_proj``, ``gate_up_proj``): ``A`` whole on every rank, ``B``
  split by rows like ``W``: the rank's rows of ``y`` get their whole low-rank sum;
* row-parallel (``o_proj``, ``down_proj``): ``A`` split by columns like ``W``, ``B``
  whole: the rank's ``(x_r @ A_r.T) @ B.T`` is a partial sum, added to the base partial
  before the layer's one all-reduce (``sum_r x_r A_r^T = x A^T``, linear in ``B``).

No extra collective. A fused column-parallel layer holds its parts' adapters side by
side: ``A`` stacks the parts' ``(R, in)`` matrices to ``(P * R, in)`` and ``B`` is block
diagonal, ``(out_local, P * R)`` with part ``p``'s rows only in columns
``[p * R, (p + 1) * R)``, so one pair of GEMMs serves all of q, k and v (or gate and up).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class LoRAStep:
    """This step's rows grouped by adapter slot, shared by every adapted layer of a model.

    ``groups``: ``(slot index, rows)`` per adapter present in the step, ``slot index`` being
    ``slot - 1`` (the pool's row) and ``rows`` an int64 tensor ``(n,)`` of flat-batch rows
    on the device. Empty when no row has an adapter.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.groups: list[tuple[int, torch.Tensor]] = []

    def set_rows(self, slots: Sequence[int], num_rows: Sequence[int], last_rows: Sequence[int]) -> None:
        """Group the step's chunks: chunk ``i`` has ``num_rows[i]`` consecutive rows ending at row
        ``last_rows[i]`` of the flat batch (which puts decodes first: worker/step_inputs.py), under
        adapter slot ``slots[i]`` (0: none).

        Raises:
            ValueError: a negative slot.
        """
        self.groups = []
        if not any(slots):  # the base model only: no LoRA work this step
            return
        rows: dict[int, list[int]] = {}
        for slot, n, last in zip(slots, num_rows, last_rows, strict=True):
            if slot < 0:
                raise ValueError(f"lora slot {slot} is negative")
            if slot:
                rows.setdefault(slot, []).extend(range(last + 1 - n, last + 1))
        self.groups = [(slot - 1, torch.tensor(r, dtype=torch.int64, device=self.device))
                       for slot, r in sorted(rows.items())]


class LoRAWeights:
    """One linear layer's adapter slots: ``a (max_loras, P * R, in_local)``, ``b (max_loras, out_local, P * R)``.

    ``scaling`` is folded into ``b`` at load. A plain object, not a module: the layer's
    ``lora`` attribute, invisible to the checkpoint loader's parameter walk.

    Args:
        step: the model's :class:`LoRAStep`.
        num_parts: ``P``, the checkpoint modules fused in the layer (3 for ``qkv_proj``).
        max_loras, max_rank: the pool's slots and ``R``.
        in_features, out_features: the layer's local ``x`` and ``y`` widths on this rank.
        dtype, device: the layer's activation dtype and device.
    """

    def __init__(self, step: LoRAStep, num_parts: int, max_loras: int, max_rank: int, in_features: int,
                 out_features: int, dtype: torch.dtype, device: torch.device) -> None:
        self.step = step
        self.num_parts = num_parts
        self.max_rank = max_rank
        width = num_parts * max_rank
        self.a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, out_features, width, dtype=dtype, device=device)

    def clear(self, index: int) -> None:
        """Empty slot ``index`` (``slot - 1``): its rows add zero."""
        self.a[index].zero_()
        self.b[index].zero_()

    def set_part(self, index: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slot ``index``'s part ``part``: ``a (r, in_local)`` and ``b (out_local, r)``, scaling already in ``b``.

        ``b`` holds the whole ``out_local`` rows with zeros outside the part's (the block-diagonal layout).
        """
        r = a.shape[0]
        if r > self.max_rank:
            raise ValueError(f"adapter rank {r} exceeds --max-lora-rank {self.max_rank}")
        first = part * self.max_rank
        self.a[index, first:first + r].copy_(a)
        self.b[index, :, first:first + r].copy_(b)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus each adapter row's low-rank path: ``x (T, in_local)``, ``y (T, out_local)``, in place.

        A row-parallel layer's ``y`` is its partial sum before the all-reduce (see the module docstring).
        """
        for index, rows in self.step.groups:
            xa = x.index_select(0, rows) @ self.a[index].T  # (n, P * R)
            y.index_add_(0, rows, xa @ self.b[index].T)  # (n, out_local) into the adapter's rows
        return y
