"""Batched low-rank adapters (LoRA, Hu et al. 2021, arXiv:2106.09685) on tensor-parallel linear layers.

An adapter adds ``scaling * (x @ A.T) @ B.T`` to a layer's ``y = x @ W.T + b``, with
``A (r, in)``, ``B (out, r)`` and ``scaling = lora_alpha / r`` (rsLoRA, Kalajdzievski 2023,
arXiv:2312.03732: ``lora_alpha / sqrt(r)``); peft's ``LoraLayer`` computes the same sum.

One step serves rows under different adapters and rows under none (Punica, Chen et al.
2023, arXiv:2310.18547; S-LoRA, arXiv:2311.03285): the base GEMM runs once over every
row, then every adapter row's low-rank path ``(x[t] @ A_s^T) @ B_s`` is added to ``y[t]``
in one call per projection over the stacked slots (punica's BGMV: ``lora_add_``,
worker/kernels/cpu_lora.cpp), each row reading its own slot's ``A`` and ``B``. Where the
compiled kernels are not loaded (another dtype, a CPU without AVX2), the step's rows are
grouped by adapter once per step (:attr:`LoRAStep.groups`) and each group takes two GEMMs.
The step's adapter rows are found once per step (:meth:`LoRAStep.set_rows`); a step with
none does no LoRA work at all: :attr:`LoRAStep.row_slots` is None, the linear layers' one
branch is false, and the compiled decode block (worker/layers/decode_block.py) runs its
no-LoRA code.

Slots: a fixed pool of ``max_loras`` resident adapters sized at start-up, each padded to
``max_lora_rank`` (zero rows of A and zero columns of B add nothing). Slot 0 is the base
model; adapter slots are ``1 .. max_loras``, stored at index ``slot - 1``. The pools are
stored as ``A (max_loras, P * R, in_local)`` (peft's ``lora_A`` orientation) and ``B (max_loras,
P * R, out_local)`` (``lora_B`` transposed), so that both products read contiguous rows.

Tensor parallelism (the Megatron split of the layer adapted, worker/layers/linear.py):

* column-parallel (``qkv_proj``, ``gate_up_proj``): ``A`` whole on every rank, ``B``
  split by rows like ``W``: the rank's rows of ``y`` get their whole low-rank sum;
* row-parallel (``o_proj``, ``down_proj``): ``A`` split by columns like ``W``, ``B``
  whole: the rank's ``(x_r @ A_r.T) @ B.T`` is a partial sum, added to the base partial
  before the layer's one all-reduce (``sum_r x_r A_r^T = x A^T``, linear in ``B``).

No extra collective. A fused column-parallel layer holds its parts' adapters side by
side: ``A`` stacks the parts' ``(R, in)`` matrices to ``(P * R, in)`` and ``B`` is block
diagonal, ``(P * R, out_local)`` with part ``p``'s columns only in rows
``[p * R, (p + 1) * R)``, so one pair of products serves all of q, k and v (or gate and up).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.kernels import cpu_kernels_available


class LoRAStep:
    """This step's adapter rows, found once per step and shared by every adapted layer of a model.

    ``row_slots``: int64 ``(T,)`` on the device, each flat-batch row's slot index (``slot - 1``,
    the pools' row; -1: the base model), or None when no row has an adapter (the step does no
    LoRA work). :attr:`groups`: the same rows grouped by adapter, for the path without the
    compiled kernel.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.row_slots: torch.Tensor | None = None
        self._slots: list[int] = []
        self._groups: list[tuple[int, torch.Tensor]] | None = []

    def set_rows(self, slots: Sequence[int], num_rows: Sequence[int], last_rows: Sequence[int]) -> None:
        """Group the step's chunks: chunk ``i`` has ``num_rows[i]`` consecutive rows ending at row
        ``last_rows[i]`` of the flat batch (which puts decodes first: worker/step_inputs.py), under
        adapter slot ``slots[i]`` (0: none).

        Raises:
            ValueError: a negative slot.
        """
        self.row_slots, self._groups = None, []
        if not any(slots):  # the base model only: no LoRA work this step
            return
        per_row = [-1] * sum(num_rows)
        for slot, n, last in zip(slots, num_rows, last_rows, strict=True):
            if slot < 0:
                raise ValueError(f"lora slot {slot} is negative")
            if slot:
                per_row[last + 1 - n:last + 1] = [slot - 1] * n
        self._slots, self._groups = per_row, None  # grouped on first use only
        self.row_slots = torch.tensor(per_row, dtype=torch.int64, device=self.device)

    @property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """``(slot index, rows)`` per adapter present in the step, in slot order: ``rows`` an int64
        ``(n,)`` tensor of flat-batch rows on the device. Empty when no row has an adapter."""
        if self._groups is None:
            rows: dict[int, list[int]] = {}
            for row, index in enumerate(self._slots):
                if index >= 0:
                    rows.setdefault(index, []).append(row)
            self._groups = [(index, torch.tensor(r, dtype=torch.int64, device=self.device))
                            for index, r in sorted(rows.items())]
        return self._groups


class LoRAWeights:
    """One linear layer's adapter slots: ``a (max_loras, P * R, in_local)``, ``b (max_loras, P * R, out_local)``.

    ``scaling`` is folded into ``b`` at load. A plain object, not a module: the layer's
    ``lora`` attribute, invisible to the checkpoint loader's parameter walk. The pools are
    filled in place (never replaced), so the compiled decode block may keep references to them.

    Args:
        step: the model's :class:`LoRAStep`.
        num_parts: ``P``, the checkpoint modules fused in the layer (3 for ``qkv_proj``).
        max_loras, max_rank: the pool's slots and ``R``.
        in_features, out_features: the layer's local ``x`` and ``y`` widths on this rank.
        dtype, device: the layer's activation dtype and device.
        part_widths: a fused layer's parts' local output widths in order (q, k, v; gate, up), summing
            to ``out_features``; empty for one part. Part ``p``'s rows of ``b`` reach only its columns.

    Raises:
        ValueError: ``part_widths`` that do not split ``out_features`` into ``num_parts``.
    """

    def __init__(self, step: LoRAStep, num_parts: int, max_loras: int, max_rank: int, in_features: int,
                 out_features: int, dtype: torch.dtype, device: torch.device,
                 part_widths: Sequence[int] = ()) -> None:
        self.step = step
        self.num_parts = num_parts
        self.part_widths = list(part_widths) if part_widths else [out_features]  # each part's columns of y
        if len(self.part_widths) != num_parts or sum(self.part_widths) != out_features:
            raise ValueError(f"part_widths {self.part_widths} do not split out_features={out_features} "
                             f"into {num_parts} parts")
        self.max_rank = max_rank
        width = num_parts * max_rank
        self.a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)
        # Punica's BGMV in one compiled call per projection (float32 CPU ranks), else a GEMM pair per adapter.
        self.batched = device.type == "cpu" and dtype == torch.float32 and cpu_kernels_available()

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
        self.b[index, first:first + r].copy_(b.T)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus each adapter row's low-rank path: ``x (T, in_local)``, ``y (T, out_local)``, in place.

        A row-parallel layer's ``y`` is its partial sum before the all-reduce (see the module docstring).
        """
        row_slots = self.step.row_slots
        if row_slots is None:
            return y
        if self.batched and y.is_contiguous():
            torch.ops.tpserve_cpu.lora_add_(y, x, self.a, self.b, row_slots, self.part_widths)  # every row, one call
            return y
        for index, rows in self.step.groups:
            xa = x.index_select(0, rows) @ self.a[index].T  # (n, P * R)
            y.index_add_(0, rows, xa @ self.b[index])  # (n, out_local) into the adapter's rows
        return y
