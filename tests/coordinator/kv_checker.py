"""A simulated worker KV cache for the scheduler's tests (tests/coordinator/test_prefix_caching.py,
test_kv_host_tier.py): it applies every plan as a rank does (drop, register, extend block tables) and
keeps, per KV slot, the tokens whose K/V it holds, so that a chunk reading a wrong K/V fails."""

from __future__ import annotations

from coordinator.scheduler import Scheduler
from coordinator.sequence import Sequence, StopParams
from tpserve.step import SamplingParams, StepPlan, StepResult

EOS = 2


def make_seq(seq_id: int, prompt: list[int], max_tokens: int = 8, max_model_len: int = 1024) -> Sequence:
    return Sequence(seq_id, list(prompt), SamplingParams(temperature=0.0), StopParams(max_tokens, frozenset({EOS})),
                    max_model_len)


class KVChecker:
    """What the workers' KV cache holds, slot by slot: the context each slot's K/V was computed from."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[list[tuple[int, ...] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.tables: dict[int, list[int]] = {}

    def apply(self, plan: StepPlan, seqs: dict[int, Sequence]) -> None:
        for seq_id in plan.finished_seq_ids:
            del self.tables[seq_id]
        for new in plan.new_seqs:
            assert new.seq_id not in self.tables
            self.tables[new.seq_id] = []
        for chunk in plan.scheduled:
            table = self.tables[chunk.seq_id]
            table.extend(chunk.new_block_ids)
            seq = seqs[chunk.seq_id]
            for pos in range(chunk.start_position):  # the history it attends to
                held = self.slots[table[pos // self.block_size]][pos % self.block_size]
                assert held == seq.token_ids(0, pos + 1), f"seq {chunk.seq_id} reads a wrong K/V at position {pos}"
            for offset, token in enumerate(chunk.token_ids):
                pos = chunk.start_position + offset
                assert seq.token_ids(pos, pos + 1) == (token,)
                self.slots[table[pos // self.block_size]][pos % self.block_size] = seq.token_ids(0, pos + 1)


def run_step(scheduler: Scheduler, checker: KVChecker, seqs: dict[int, Sequence], token: int = 7) -> StepPlan:
    plan = scheduler.schedule()
    scheduler.check_invariants()  # the plan writes no cached or shared block
    checker.apply(plan, seqs)
    scheduler.update(plan, StepResult(plan.step_id, (token,) * plan.num_samples))
    scheduler.check_invariants()
    return plan


