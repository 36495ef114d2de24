"""Continuous batching over the paged KV cache: ``schedule() -> StepPlan`` and ``update(plan, result)``.

Policy (vLLM v1 style: a token budget, no prefill/decode modes). Each step:

1. Running sequences, oldest first, each get the tokens it has not computed yet
   (one for a decode, the rest of the prompt, or a chunk of it, for a prefill),
   within ``max_num_batched_tokens``. When the KV blocks they need are not free,
   the least urgent, newest running sequence not yet scheduled in this step is
   preempted: its blocks are freed and it goes back to the queue, ahead of every later
   request of its rank, to be recomputed later (recompute preemption). With the host tier
   (``host_tier``) its full blocks, still cached, are copied out when the pool reuses them and
   copied back at its readmission instead (swap preemption: coordinator/kv_host_tier.py).
   Before that, a waiting sequence that cannot be admitted (too few free blocks, no
   free slot) preempts less urgent running sequences to take their place.
   Urgency is priority aged by waiting, and an admitted sequence is not preempted
   before its next token unless nothing else could run (:mod:`coordinator.priority`).
2. If nothing was preempted, waiting sequences are admitted in that order (first come, first served within a rank),
   while the step has token budget, a sequence slot (``max_num_seqs``) and free blocks for the whole remaining prompt:
   a request is admitted only when its blocks fit. A long prompt may be split into chunks over several steps. With
   prefix caching, an admitted sequence first takes references to the cached blocks its tokens start with (at most all
   but its last token, whose logits it needs) and starts computing after them: its first chunk has
   ``start_position > 0`` and carries its whole block table.
3. Sequences finished or aborted since the last plan are named in it, so the
   workers drop their state.

Speculative decoding (with a ``proposer``): a running sequence in decode whose sampling allows it
(``SamplingParams.allows_speculation``) gets up to k proposed tokens after its last one, within the step's token
budget (leaving one token for each later running sequence), ``max_tokens`` and ``max_model_len``, and the KV blocks
they need: when those are not free it decodes without proposals (never preempting for a guess). ``update`` appends the
accepted tokens one at a time under the stop rules, counts only the verified positions as computed (so the prefix
cache never registers a block holding a rejected token, whose slot is simply overwritten later), and frees the blocks
reserved beyond the sequence's new length; the next plan tells the workers to cut their block tables to match. With a
draft model (``--speculative-method draft``) the chunk only names how many tokens the workers' draft proposes
(``num_draft_tokens``); the rest is the same.

Which blocks a sequence gets, and prefix caching (block hashes, look-ups, hit counts), are
the KV-cache manager's (:mod:`coordinator.kv_cache_manager`); the scheduler asks it for blocks.

Hybrid models (``state_slots``, :mod:`coordinator.state_slots`): an admitted sequence also takes a live state slot
(none free: it waits, like for blocks) and gives it back when it finishes, is aborted or preempted (a preempted one is
recomputed from a zeroed slot); a prefix hit restores its state from the checkpoint at the hit's end (the plan's
``restored_states``), and prompt chunks save checkpoints at the block boundaries they cross (``state_checkpoints``).

``update`` records the blocks that the step filled in the prefix cache, appends the sampled tokens, applies the
token-level stop rules and frees the blocks of sequences that finished. Text-level stops (stop strings) are decided
by the caller, which calls ``finish``.

Async scheduling (``async_scheduling=True``; vLLM's ``--async-scheduling``): the engine plans step t+1 while step t
runs. ``schedule`` then counts a plan's chunks as computed and its samples as *pending* tokens
(``Sequence.num_pending_tokens``), which the next plan decodes as ``PLACEHOLDER_TOKEN_ID`` unless the pending token
ends the sequence by length; ``update`` puts the sampled token in its place under the stop rules. A preempted sequence
drops its pending tokens, and a result for an earlier admission of a sequence is ignored (``Sequence.admitted_step``).
docs/design/scheduling.md, "The engine loop", has the whole story.

Multi-step scheduling (``num_scheduler_steps`` > 1, several decode steps a plan): :mod:`coordinator.multi_step`.

Pure Python, no torch: the invariants (every block free or held, ref counts equal holders, nothing leaked after
finish, abort or preempt, no cached block written) are checkable after any step with ``check_invariants``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from coordinator.block_allocator import BlockAllocator, num_blocks_for
from coordinator.kv_cache_manager import KVCacheManager
from coordinator.kv_host_tier import HostTier
from coordinator.multi_step import admission_blocked, apply_steps, check_num_steps, multi_step_chunks
from coordinator.ngram_proposer import DraftModelProposer, NgramProposer
from coordinator.priority import DEFAULT_PRIORITY_AGING_S, PriorityPolicy
from coordinator.spec_decode import SpecDecodeStats
from coordinator.state_slots import StateSlots
from coordinator.spec_scheduling import TokenOutput, apply_verified, propose, tokens_per_sample
from coordinator.scheduler_invariants import cached_blocks_written, check_invariants
from coordinator.sequence import FinishReason, Sequence, SequenceStatus, scheduled_chunk
from tpserve.step import NewSequence, ScheduledChunk, StepPlan, StepResult

__all__ = ["Scheduler", "TokenOutput"]


class Scheduler:
    """Decides each step's batch and owns every sequence's KV blocks.

    Args:
        allocator: the block allocator of the worker group's KV pool.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step.
        enable_prefix_caching: share full blocks between sequences with the same
            tokens up to them (``--enable-prefix-caching``).
        check_writes: record, at each ``schedule``, any block the plan writes that is
            cached or shared, for ``check_invariants`` (tests; costs a little per step).
        proposer: speculative decoding's proposer (``--speculative-method ngram`` or ``draft``); None: off.
        disable_speculation_above: no proposals while more sequences than this run
            (``--speculative-disable-by-batch-size``); None: no limit.
        async_scheduling: plans may be made before the previous step's result is applied
            (see the module docstring); not with a proposer.
        priority_aging_s: seconds of waiting worth one priority level (``--priority-aging-seconds``;
            0: strict priority); ``clock``: monotonic seconds (:mod:`coordinator.priority`).
        state_slots: a hybrid model's state slots (:mod:`coordinator.state_slots`); None otherwise.
        host_tier: the prefix cache's host tier (``--kv-offloading-size``; coordinator/kv_host_tier.py);
            None: one tier. Needs ``enable_prefix_caching``.
        num_scheduler_steps: most decode steps a plan runs (``--num-scheduler-steps``); >1: not with either above.

    Raises:
        ValueError: ``async_scheduling`` with a proposer (a proposal needs the tokens before it), a bad
            ``num_scheduler_steps``, a negative ``priority_aging_s``, or a ``host_tier`` without prefix caching.

    Attributes:
        kv_cache: the block tables and the prefix cache (:mod:`coordinator.kv_cache_manager`).
        spec: speculative decoding's counters (cumulative).
    """

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = False, check_writes: bool = False,
                 proposer: NgramProposer | DraftModelProposer | None = None,
                 disable_speculation_above: int | None = None, async_scheduling: bool = False,
                 priority_aging_s: float = DEFAULT_PRIORITY_AGING_S, clock: Callable[[], float] = time.monotonic,
                 state_slots: StateSlots | None = None, host_tier: HostTier | None = None,
                 num_scheduler_steps: int = 1) -> None:
        if async_scheduling and proposer is not None:
            raise ValueError("async scheduling does not combine with speculative decoding")
        self.num_scheduler_steps = check_num_steps(num_scheduler_steps, async_scheduling or proposer is not None)
        if state_slots is not None and proposer is not None:
            raise ValueError("speculative decoding is not supported for hybrid models (no state rollback)")
        self.priority = PriorityPolicy(priority_aging_s, clock)
        self.async_scheduling = async_scheduling
        self.kv_cache = KVCacheManager(allocator, enable_prefix_caching, state_slots=state_slots, host_tier=host_tier)
        self.state_slots = state_slots
        self._restores: list[tuple[int, int]] = []  # the next plan's restored_states
        self._state_saves: list[tuple[int, int, int]] = []  # and its state_checkpoints
        self.block_size = allocator.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.check_writes = check_writes
        self._bad_writes: list[int] = []
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._to_drop: list[int] = []  # seq ids the workers must forget at the next plan
        self._trims: dict[int, int] = {}  # seq id -> blocks the workers keep (after rejected proposals)
        self.proposer = proposer
        self.disable_speculation_above = disable_speculation_above
        self.spec = SpecDecodeStats(proposer.num_speculative_tokens if proposer else 0)
        self._next_step_id = 0
        self.num_preemptions = 0
        #: Called with each sequence preempted for want of KV blocks (the engine counts and logs it).
        self.on_preempt: Callable[[Sequence], None] | None = None

    @property
    def allocator(self) -> BlockAllocator:
        """The block pool (replaced when the worker group restarts)."""
        return self.kv_cache.allocator

    @property
    def enable_prefix_caching(self) -> bool:
        return self.kv_cache.enable_prefix_caching

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens looked up in the prefix cache at admission (cumulative)."""
        return self.kv_cache.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of :attr:`prefix_cache_queries`, the tokens found cached (cumulative)."""
        return self.kv_cache.prefix_cache_hits

    # -- admission and removal ---------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence (its prompt must be non-empty and fit max_model_len)."""
        seq.status = SequenceStatus.WAITING
        self.priority.stamp(seq)
        self.priority.enqueue(self.waiting, seq)

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
        self.kv_cache.free(seq)
        if self.state_slots is not None and seq.state_slot >= 0:
            self.state_slots.free_live(seq.state_slot)
            seq.state_slot = -1
        seq.num_computed_tokens = 0
        seq.num_pending_tokens = 0  # what steps in flight sample for it is dropped: it is recomputed
        self._trims.pop(seq.seq_id, None)  # the workers drop the whole table
        if seq.on_workers:
            self._to_drop.append(seq.seq_id)
            seq.on_workers = False

    def _preempt(self, seq: Sequence, for_blocks: bool = True) -> None:
        """Back to the front of the queue, blocks freed; ``for_blocks``: for want of KV blocks
        (counted, reported to ``on_preempt``), not a worker group restart."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.note_preempted()  # and when: the request's timings and trace
        self.num_preemptions += 1
        self.priority.enqueue(self.waiting, seq)  # older than every waiting sequence of its rank: first among them
        if for_blocks and self.on_preempt is not None:
            self.on_preempt(seq)

    def reset_workers(self) -> int:
        """The worker group was replaced (restarted after a failure): its KV caches are empty.

        Every running sequence goes back to the front of the queue, oldest first, to
        be recomputed from its prompt and the tokens it has generated (a preemption
        by recompute; seeded sampling depends only on seed and position, so the
        stream continues exactly). The block pool starts afresh: cached prefixes
        named KV that no longer exists. Returns how many sequences were running.
        """
        running = list(self.running)
        for seq in reversed(running):
            self._preempt(seq, for_blocks=False)
        self._to_drop.clear()  # the new workers know no sequence
        self._trims.clear()
        for seq in self.waiting:
            seq.on_workers = False
        self.kv_cache.reset()
        return len(running)

    def schedule_alone(self, seq: Sequence) -> StepPlan:
        """A plan of ``seq`` alone, first in the queue if it waits; every other running sequence is
        left as if busy (a suspect after a failed step: coordinator/engine/probation.py)."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.waiting.appendleft(seq)
        return self.schedule(busy=frozenset(s.seq_id for s in self.running if s is not seq), max_seqs=1)

    # -- the two verbs -----------------------------------------------------------------

    def has_work(self) -> bool:
        """Whether ``schedule`` would produce a plan with work (or drops to send)."""
        return bool(self.running or self.waiting or self._to_drop)

    def schedule(self, busy: frozenset[int] = frozenset(), max_seqs: int | None = None) -> StepPlan:
        """Builds the next step's plan; see the module docstring for the policy.

        Pipeline micro-batches (coordinator/engine/step_loop.py): ``busy`` are the ids of running
        sequences in a step still in flight: they are neither scheduled nor preempted (that
        step still writes their blocks) until its result is applied; ``max_seqs`` caps the
        sequences of this plan (None: ``max_num_seqs``), so the batches share them out.
        """
        cap = self.max_num_seqs if max_seqs is None else max_seqs
        new_seqs: list[NewSequence] = []
        scheduled: list[ScheduledChunk] = []
        multi_step = self.num_scheduler_steps > 1 and not busy and admission_blocked(  # coordinator/multi_step.py
            self.waiting, self.running, self.max_num_seqs, self.priority)
        num_steps = multi_step_chunks(self.running, min(cap, self.max_num_batched_tokens), self.num_scheduler_steps,
                                      self.kv_cache, scheduled) if multi_step else 1
        if num_steps == 1:
            self._preempt_for_priority(busy)
            budget, preempted = self._schedule_running(busy, cap, scheduled)
            if not preempted:  # a preemption, or a sequence waiting for blocks: no admission in this step
                self._schedule_waiting(budget, cap, scheduled, new_seqs)
        if self.check_writes:
            self._bad_writes = cached_blocks_written(scheduled, self.running, self.allocator)
        plan = StepPlan(self._next_step_id, tuple(new_seqs), tuple(scheduled), tuple(self._to_drop),
                        tuple(self._trims.items()), tuple(self._restores), tuple(self._state_saves),
                        *self.kv_cache.take_copy_orders(), num_steps)  # host tier (kv_host_tier.py)
        if self.state_slots is not None:
            self._restores, self._state_saves = [], []
            self.state_slots.end_plan()
        self._next_step_id += 1
        self._to_drop = []
        self._trims = {}
        return plan

    def _schedule_running(self, busy: frozenset[int], cap: int, scheduled: list[ScheduledChunk]) -> tuple[int, bool]:
        """The running pass (module docstring, 1): appends their chunks to ``scheduled``;
        returns the token budget left and whether a sequence was preempted or waits for blocks."""
        budget = self.max_num_batched_tokens
        preempted = False
        speculate = self.proposer is not None and (self.disable_speculation_above is None
                                                   or len(self.running) <= self.disable_speculation_above)
        index = 0
        while index < len(self.running) and budget > 0 and len(scheduled) < cap:
            seq = self.running[index]
            if seq.seq_id in busy or seq.num_pending_tokens and self._pending_is_last(seq):
                index += 1
                continue
            num_new = min(seq.num_tokens + seq.num_pending_tokens - seq.num_computed_tokens, budget)
            # Speculation spends budget only where every later running sequence keeps a token.
            proposal, num_draft = propose(self.proposer, seq, budget - num_new - (len(self.running) - index - 1)) \
                if speculate and num_new == seq.num_tokens - seq.num_computed_tokens == 1 else ((), 0)
            num_spec = len(proposal) + num_draft
            new_block_ids = self.kv_cache.grow(seq, num_new + num_spec) if num_spec else None
            if new_block_ids is None:
                proposal, num_draft, num_spec = (), 0, 0  # no room for guesses: decode as usual (preempt if need be)
                new_block_ids = self.kv_cache.grow(seq, num_new)
            while new_block_ids is None:
                # Among those not scheduled yet (seq and later); a protected one only if nothing else would run.
                victim = self.priority.pick_victim([s for s in self.running[index:] if s.seq_id not in busy],
                                                   allow_protected=not scheduled)
                preempted = True
                if victim is None:
                    break  # none has progressed since admitted: seq waits while those scheduled before it run
                self._preempt(victim)
                if victim is seq:
                    break
                new_block_ids = self.kv_cache.grow(seq, num_new)
            if new_block_ids is None:
                index += seq.status is SequenceStatus.RUNNING  # waits: next; preempted: the next is at index
                continue
            scheduled.append(scheduled_chunk(seq, num_new, new_block_ids, proposal, num_draft))
            if self.state_slots is not None:
                self._state_saves += self.kv_cache.state_checkpoints(seq, scheduled[-1].start_position, num_new)
            budget -= num_new + num_spec
            index += 1
            if self.async_scheduling:
                self._count_planned(seq, scheduled[-1])
        return budget, preempted

    def _schedule_waiting(self, budget: int, cap: int, scheduled: list[ScheduledChunk],
                          new_seqs: list[NewSequence]) -> None:
        """The waiting pass (module docstring, 2): admits waiting sequences in order while
        ``budget`` tokens, a slot and their blocks last; appends their chunks and descriptions."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and len(scheduled) < cap:
            seq = self.waiting[0]
            cached = self.kv_cache.cached_prefix(seq)
            if not self.allocator.can_allocate(self.kv_cache.num_blocks_to_admit(seq, cached)):
                break  # FCFS: do not let later, smaller requests overtake it
            if self.state_slots is not None and not self.state_slots.num_free_live:
                break  # a hybrid's sequence needs a live state slot too
            restore = self.kv_cache.take_cached_prefix(seq, cached)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            new_block_ids = self.kv_cache.grow(seq, num_new)
            assert new_block_ids is not None  # checked just above
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.priority.on_admitted(seq)
            self.running.append(seq)
            # Penalties need every earlier token on the sampling rank; a cached prefix is never sent in a chunk.
            history = seq.token_ids(0, seq.num_computed_tokens) if seq.sampling.uses_token_history else ()
            prompt = tuple(seq.prompt_token_ids) if seq.sampling.prompt_logprobs is not None else ()
            if self.state_slots is not None:
                seq.state_slot = self._take_state_slot(seq, restore)
            new_seqs.append(NewSequence(seq.seq_id, seq.sampling, seq.num_prompt_tokens, history, prompt, seq.lora_slot,
                                        max(seq.state_slot, 0)))
            seq.on_workers = True
            seq.admitted_step = self._next_step_id
            scheduled.append(scheduled_chunk(seq, num_new, list(seq.block_ids)))  # new: its whole table
            if self.state_slots is not None:
                self._state_saves += self.kv_cache.state_checkpoints(seq, seq.num_computed_tokens, num_new)
            budget -= num_new
            if self.async_scheduling:
                self._count_planned(seq, scheduled[-1])

    def _take_state_slot(self, seq: Sequence, restore: int | None) -> int:
        """A hybrid's admitted sequence: its live state slot, restored from checkpoint ``restore`` if any."""
        slot = self.state_slots.take_live() if self.state_slots is not None else None
        assert slot is not None  # checked before admission
        if restore is not None:
            self._restores.append((seq.seq_id, restore))
        return slot

    def _pending_is_last(self, seq: Sequence) -> bool:
        """Async scheduling: whether the tokens steps in flight sample for ``seq`` end it by length."""
        pending = seq.num_pending_tokens
        return seq.num_output_tokens + pending >= seq.stop.max_tokens or seq.num_tokens + pending >= seq.max_model_len

    @staticmethod
    def _count_planned(seq: Sequence, chunk: ScheduledChunk) -> None:
        """Async scheduling: counts ``chunk`` as done once planned (its tokens computed, its sample pending)."""
        seq.num_computed_tokens = chunk.start_position + len(chunk.token_ids)
        seq.num_pending_tokens += chunk.sample

    def take_back(self, plan: StepPlan) -> None:
        """``plan``, the last one made, will not be sent (it schedules nothing): the sequences it
        tells the workers to drop or trim go in the next plan instead."""
        self._to_drop[:0] = plan.finished_seq_ids
        for seq_id, num_blocks in plan.trimmed_block_tables:
            self._trims.setdefault(seq_id, num_blocks)
        if (plan.kv_swap_out or plan.kv_swap_in) and self.kv_cache.host_tier is not None:
            self.kv_cache.host_tier.put_back_orders(plan.kv_swap_out, plan.kv_swap_in)

    def update(self, plan: StepPlan, result: StepResult) -> list[TokenOutput]:
        """Applies a step's sampled tokens; returns them with the sequences' finish reasons.

        Sequences finished or aborted while the step ran are skipped: their tokens are dropped;
        so are those of a sequence preempted and admitted again since the plan.
        A chunk with proposals may give several tokens, in order; nothing after a stop.

        Raises:
            ValueError: the result does not carry one token per sampling chunk (plus
                the accepted proposals), or accepts more proposals than a chunk had.
        """
        counts = tokens_per_sample(plan, result)
        seqs = {seq.seq_id: seq for seq in self.running}
        for scored in result.prompt_logprobs:  # before the first token: the engine reports them with it
            seq = seqs.get(scored.seq_id)
            for offset, logprob in enumerate(scored.logprobs if seq is not None else ()):
                seq.prompt_logprobs.setdefault(scored.first_position + offset, (
                    logprob, scored.top_token_ids[offset] if scored.top_token_ids else (),
                    scored.top_logprobs[offset] if scored.top_logprobs else ()))
        outputs: list[TokenOutput] = []
        offset = 0
        logprobs = {lp.sample_index: lp for lp in result.logprobs}
        sample_index, num_steps = -1, plan.num_steps  # (a local: read per chunk)
        for chunk in plan.scheduled:
            token_id = result.sampled_token_ids[offset] if chunk.sample else None
            sample_index += chunk.sample
            num_sampled = counts[sample_index] if chunk.sample else 0
            offset += num_sampled
            seq = seqs.get(chunk.seq_id)
            if seq is None or seq.admitted_step > plan.step_id:
                continue  # finished, aborted or preempted after the plan was made
            if num_steps > 1:
                outputs += apply_steps(seq, chunk, result.sampled_token_ids[offset - num_sampled:offset],
                                       self.kv_cache, logprobs, sample_index * num_steps)
                if outputs[-1].finish_reason is not None:
                    self.finish(seq, outputs[-1].finish_reason)
                continue
            if chunk.num_spec_tokens or chunk.num_draft_tokens:
                outputs += self._apply_verified(seq, chunk, result.sampled_token_ids[offset - num_sampled:offset])
                continue
            # Async scheduling counted the chunk when it was planned (and later plans may have
            # gone further); the cache registers blocks only up to the tokens known now.
            num_computed = chunk.start_position + len(chunk.token_ids)
            self.kv_cache.cache_full_blocks(seq, num_computed, chunk.start_position)
            seq.note_computed(chunk.start_position, num_computed)
            if token_id is None:
                continue
            if seq.num_pending_tokens:
                seq.num_pending_tokens -= 1
            reason = seq.append_token(token_id)
            if reason is not None:
                self.finish(seq, reason)
            outputs.append(TokenOutput(seq, token_id, reason, logprobs.get(sample_index)))
        return outputs

    # -- speculative decoding (coordinator/spec_scheduling.py) ------------------------

    def _apply_verified(self, seq: Sequence, chunk: ScheduledChunk, token_ids: tuple[int, ...]) -> list[TokenOutput]:
        """Appends a verified chunk's tokens up to a stop; frees the blocks of rejected positions."""
        outputs = apply_verified(seq, chunk, token_ids, self.kv_cache, self.spec)
        if outputs[-1].finish_reason is not None:
            self.finish(seq, outputs[-1].finish_reason)
            return outputs
        keep = num_blocks_for(seq.num_tokens, self.block_size)
        if len(seq.block_ids) > keep:  # blocks reserved for rejected proposals go back to the pool
            self.kv_cache.trim(seq, keep)
            self._trims[seq.seq_id] = keep
        return outputs

    # -- priority ----------------------------------------------------------------------

    def _preempt_for_priority(self, busy: frozenset[int] = frozenset()) -> None:
        """The first waiting sequence takes the place of less urgent running ones (not protected:
        :mod:`coordinator.priority`) when it cannot be admitted otherwise (too few free blocks for
        its prompt, or no free slot): they are preempted, least urgent and newest first, until it
        fits. Nothing is preempted when even all of them would not make room."""
        if not self.waiting:
            return
        head, policy = self.waiting[0], self.priority
        lower = [seq for seq in self.running if policy.outranks(head, seq) and seq.seq_id not in busy
                 and not policy.is_protected(seq)]
        if not lower:
            return
        num_needed = self.kv_cache.num_blocks_to_admit(head, self.kv_cache.cached_prefix(head))
        reclaimable = sum(1 for seq in lower for block_id in seq.block_ids if self.allocator.ref_count(block_id) == 1)
        if num_needed > self.allocator.num_free_blocks + reclaimable:
            return
        while lower and not (self.allocator.can_allocate(num_needed) and len(self.running) < self.max_num_seqs):
            victim = max(lower, key=lambda seq: (policy.rank(seq), self.running.index(seq)))
            lower.remove(victim)
            self._preempt(victim)

    # -- helpers -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Asserts the block pool's bookkeeping against the live sequences
        (:func:`coordinator.scheduler_invariants.check_invariants`; with ``check_writes``, also
        that the last plan wrote no cached or shared block).

        Raises:
            AssertionError: a leaked, double-held, miscounted or overwritten block, or a
                sequence in the wrong queue.
        """
        check_invariants(self.running, self.waiting, self.allocator, self._bad_writes)
        if self.state_slots is not None:  # one live state slot per running sequence, none leaked
            held = [seq.state_slot for seq in self.running]
            assert len(set(held)) == len(held) and set(held) == self.state_slots.held_live, \
                f"live state slots {sorted(self.state_slots.held_live)} held, running sequences hold {sorted(held)}"
