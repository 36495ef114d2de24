"""Continuous batching over the paged KV cache: ``schedule() -> StepPlan`` and ``update(plan, result)``.

Policy (vLLM v1 style: a token budget, no prefill/decode modes). Each step:

1. Running sequences, oldest first, each get the tokens it has not computed yet
   (one for a decode, the rest of the prompt, or a chunk of it, for a prefill),
   within ``max_num_batched_tokens``. When the KV blocks they need are not free,
   the newest running sequence is preempted: its blocks are freed and it goes
   back to the front of the queue, to be recomputed later (recompute preemption).
2. If nothing was preempted, waiting sequences are admitted first come, first
   served, while the step has token budget, a sequence slot (``max_num_seqs``)
   and free blocks for the whole remaining prompt: a request is admitted only
   when its blocks fit. A long prompt may be split into chunks over several steps.
3. Sequences finished or aborted since the last plan are named in it, so the
   workers drop their state.

``update`` appends the sampled tokens, applies the token-level stop rules and frees
the blocks of sequences that finished. Text-level stops (stop strings) are decided
by the caller, which calls ``finish``.

Pure Python, no torch: the invariants (every block free or held once by a live
sequence, nothing leaked after finish, abort or preempt) are checkable after any step
with ``check_invariants``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from coordinator.block_allocator import BlockAllocator, num_blocks_for
from coordinator.sequence import FinishReason, Sequence, SequenceStatus
from tpserve.step import NewSequence, ScheduledChunk, StepPlan, StepResult


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """One sampled token for one sequence, and why the sequence stopped, if it did."""

    seq: Sequence
    token_id: int
    finish_reason: FinishReason | None


class Scheduler:
    """Decides each step's batch and owns every sequence's KV blocks.

    Args:
        allocator: the block allocator of the worker group's KV pool.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step.
    """

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._to_drop: list[int] = []  # seq ids the workers must forget at the next plan
        self._next_step_id = 0
        self.num_preemptions = 0

    # -- admission and removal ---------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence (its prompt must be non-empty and fit max_model_len)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Ends a sequence now (stop string, abort, cancel): frees its blocks at once.

        The blocks may be reused by the next plan, which also tells the workers to drop
        the sequence before anything else, so no rank reads them for this sequence again.
        """
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        if seq.on_workers:
            self._to_drop.append(seq.seq_id)
            seq.on_workers = False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- the two verbs -----------------------------------------------------------------

    def has_work(self) -> bool:
        """Whether ``schedule`` would produce a plan with work (or drops to send)."""
        return bool(self.running or self.waiting or self._to_drop)

    def schedule(self) -> StepPlan:
        """Builds the next step's plan; see the module docstring for the policy."""
        budget = self.max_num_batched_tokens
        new_seqs: list[NewSequence] = []
        scheduled: list[ScheduledChunk] = []
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            new_block_ids = self._grow(seq, num_new)
            while new_block_ids is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
                new_block_ids = self._grow(seq, num_new)
            if new_block_ids is None:
                break  # seq itself was preempted; every older one is scheduled
            scheduled.append(self._chunk(seq, num_new, new_block_ids))
            budget -= num_new
            index += 1

        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            remaining = seq.num_tokens - seq.num_computed_tokens
            if not self.allocator.can_allocate(num_blocks_for(seq.num_tokens, self.block_size)):
                break  # FCFS: do not let later, smaller requests overtake it
            num_new = min(remaining, budget)
            new_block_ids = self._grow(seq, num_new)
            assert new_block_ids is not None  # checked just above
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            new_seqs.append(NewSequence(seq.seq_id, seq.sampling))
            seq.on_workers = True
            scheduled.append(self._chunk(seq, num_new, new_block_ids))
            budget -= num_new

        plan = StepPlan(self._next_step_id, tuple(new_seqs), tuple(scheduled), tuple(self._to_drop))
        self._next_step_id += 1
        self._to_drop = []
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> list[TokenOutput]:
        """Applies a step's sampled tokens; returns them with the sequences' finish reasons.

        Sequences finished or aborted while the step ran are skipped: their tokens are dropped.

        Raises:
            ValueError: the result does not carry one token per sampling chunk.
        """
        if len(result.sampled_token_ids) != plan.num_samples:
            raise ValueError(f"step {plan.step_id}: {len(result.sampled_token_ids)} tokens for {plan.num_samples} samples")
        seqs = {seq.seq_id: seq for seq in self.running}
        outputs: list[TokenOutput] = []
        tokens = iter(result.sampled_token_ids)
        for chunk in plan.scheduled:
            token_id = next(tokens) if chunk.sample else None
            seq = seqs.get(chunk.seq_id)
            if seq is None:
                continue  # finished, aborted or preempted after the plan was made
            seq.num_computed_tokens += chunk.num_tokens
            if token_id is None:
                continue
            reason = seq.append_token(token_id)
            if reason is not None:
                self.finish(seq, reason)
            outputs.append(TokenOutput(seq, token_id, reason))
        return outputs

    # -- helpers -----------------------------------------------------------------------

    def _grow(self, seq: Sequence, num_new: int) -> list[int] | None:
        """Allocates the blocks ``seq`` needs to hold ``num_new`` more tokens (None: too few free)."""
        needed = num_blocks_for(seq.num_computed_tokens + num_new, self.block_size) - len(seq.block_ids)
        if needed <= 0:
            return []
        block_ids = self.allocator.allocate(needed)
        if block_ids is not None:
            seq.block_ids.extend(block_ids)
        return block_ids

    @staticmethod
    def _chunk(seq: Sequence, num_new: int, new_block_ids: list[int]) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(
            seq_id=seq.seq_id,
            token_ids=seq.token_ids(start, start + num_new),
            start_position=start,
            new_block_ids=tuple(new_block_ids),
            sample=start + num_new == seq.num_tokens,
        )

    def check_invariants(self) -> None:
        """Asserts that every block is free or held by exactly one live sequence.

        Raises:
            AssertionError: a leaked, double-held or miscounted block, or a sequence
                in the wrong queue.
        """
        assert all(seq.status is SequenceStatus.RUNNING for seq in self.running)
        assert all(seq.status is SequenceStatus.WAITING and not seq.block_ids for seq in self.waiting)
        for seq in self.running:
            assert len(seq.block_ids) >= num_blocks_for(seq.num_computed_tokens, self.block_size)
        self.allocator.check_invariants(seq.block_ids for seq in self.running)
