"""The rank's persistent batch: every known sequence's block table in one preallocated tensor.

A plan is a delta (tpserve/step.py): new sequences, blocks appended to running ones,
finished ones dropped, tables trimmed after rejected proposals. Rebuilding each
step's ``(S, B)`` block-table tensor from Python lists costs ``O(S x B)`` list
operations per step; here each sequence owns a row of a host tensor for as long as
it lives, the plan's delta is written into it in place (a few element writes per
step), and a step's tables are one ``index_select`` of its sequences' rows (vLLM
v1's ``InputBatch`` / ``BlockTable`` idea).

Columns past a sequence's blocks hold block 0 (rows are zeroed when freed or
trimmed): the attention backends read them only under a mask, or never.
Rows and columns grow by doubling when a step needs more; nothing shrinks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class InputBatch:
    """Block tables of the sequences a rank holds, one row each, in a host ``int64`` tensor.

    Args:
        max_blocks_per_seq: columns to start with (a sequence with more grows the tensor).
        capacity: rows to start with.
    """

    def __init__(self, max_blocks_per_seq: int, capacity: int = 64) -> None:
        self.block_tables = torch.zeros(capacity, max(1, max_blocks_per_seq), dtype=torch.int64)  # (R, B)
        self.num_blocks = [0] * capacity  # per row: blocks in its table
        self._rows: dict[int, int] = {}  # seq_id -> row
        self._free = list(range(capacity - 1, -1, -1))  # free rows, the lowest last (popped first)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._rows

    def add(self, seq_id: int) -> None:
        """Registers ``seq_id`` with an empty table (an id already held is reset)."""
        row = self._rows.get(seq_id)
        if row is None:
            if not self._free:
                self._grow_rows()
            row = self._rows[seq_id] = self._free.pop()
        self._clear(row, 0)

    def remove(self, seq_id: int) -> None:
        """Drops ``seq_id`` (unknown ids are ignored); its row is zeroed and reused."""
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._clear(row, 0)
            self._free.append(row)

    def append_blocks(self, seq_id: int, block_ids: Sequence[int]) -> None:
        """Appends ``block_ids`` to ``seq_id``'s table."""
        row = self._rows[seq_id]
        start = self.num_blocks[row]
        end = start + len(block_ids)
        if end > self.block_tables.shape[1]:
            self._grow_columns(end)
        self.block_tables[row, start:end] = torch.tensor(block_ids, dtype=torch.int64)
        self.num_blocks[row] = end

    def trim(self, seq_id: int, num_blocks: int) -> None:
        """Keeps the first ``num_blocks`` blocks of ``seq_id``'s table (unknown ids are ignored)."""
        row = self._rows.get(seq_id)
        if row is not None and num_blocks < self.num_blocks[row]:
            self._clear(row, max(0, num_blocks))

    def tables(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """``(S, B) int64`` the tables of ``seq_ids`` in that order, ``B`` the longest of them (a new tensor)."""
        rows = list(map(self._rows.__getitem__, seq_ids))
        width = max(map(self.num_blocks.__getitem__, rows))
        return self.block_tables[:, :width].index_select(0, torch.tensor(rows, dtype=torch.int64))

    def _clear(self, row: int, keep: int) -> None:
        self.block_tables[row, keep: self.num_blocks[row]] = 0
        self.num_blocks[row] = keep

    def _grow_rows(self) -> None:
        old = self.block_tables.shape[0]
        self.block_tables = torch.cat([self.block_tables, torch.zeros_like(self.block_tables)])
        self.num_blocks.extend([0] * old)
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _grow_columns(self, needed: int) -> None:
        width = self.block_tables.shape[1]
        while width < needed:
            width *= 2
        grown = torch.zeros(self.block_tables.shape[0], width, dtype=torch.int64)
        grown[:, : self.block_tables.shape[1]] = self.block_tables
        self.block_tables = grown
