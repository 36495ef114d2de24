"""Speculative decoding in the scheduler: pure Python, a deterministic fake target model.

The fake workers verify each proposal exactly as the real ones do (accept while the
target's token equals the proposal, then one more token), and a slot-level model of
the KV cache checks that every position a sequence attends to holds the K/V of its
real tokens: a rollback that counted a rejected position as computed, cached a block
holding a rejected token, or let the workers' block tables drift from the
coordinator's fails here. Reference for the outputs: the same workload without
speculation, token for token.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from coordinator.block_allocator import BlockAllocator
from coordinator.ngram_proposer import NgramProposer
from coordinator.scheduler import Scheduler
from coordinator.sequence import FinishReason, Sequence, StopParams
from coordinator.spec_decode import AdaptiveSpeculation
from tests.coordinator.fakes import EOS, make_seq
from tpserve.step import SamplingParams, StepPlan, StepResult

Target = Callable[[tuple[int, ...]], int]


def repetitive_target(context: tuple[int, ...]) -> int:
    """A function of the last two tokens (so the text falls into loops the proposer finds), with a
    position-dependent twist every 7th position (so some proposals are rejected) and a rare eos."""
    a, b = context[-2:] if len(context) >= 2 else (0, context[-1])
    if len(context) % 7 == 0:
        return 3 + (a * 5 + len(context)) % 9
    token = 3 + (a * 3 + b * 5) % 11
    return EOS if token == 13 and len(context) % 3 == 0 else token


class FakeWorkers:
    """Executes plans against a slot-level model of the paged KV cache and a target function."""

    def __init__(self, num_blocks: int, block_size: int, target: Target) -> None:
        self.block_size = block_size
        self.target = target
        self.slots: list[list[tuple[int, ...] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.tables: dict[int, list[int]] = {}

    def execute(self, plan: StepPlan, seqs: dict[int, Sequence]) -> StepResult:
        for seq_id in plan.finished_seq_ids:
            del self.tables[seq_id]
        for seq_id, num_blocks in plan.trimmed_block_tables:
            del self.tables[seq_id][num_blocks:]
        for new in plan.new_seqs:
            assert new.seq_id not in self.tables
            self.tables[new.seq_id] = []
        tokens: list[int] = []
        accepted: list[int] = []
        for chunk in plan.scheduled:
            seq, table = seqs[chunk.seq_id], self.tables[chunk.seq_id]
            table.extend(chunk.new_block_ids)
            assert table == seq.block_ids, "the workers' block table drifted from the coordinator's"
            start, k = chunk.start_position, chunk.num_spec_tokens
            for pos in range(start):  # the history it attends to holds its real tokens' K/V
                held = self.slots[table[pos // self.block_size]][pos % self.block_size]
                assert held == seq.token_ids(0, pos + 1), f"seq {chunk.seq_id} reads a wrong K/V at position {pos}"
            real = chunk.num_tokens - k
            assert chunk.token_ids[:real] == seq.token_ids(start, start + real)
            context = seq.token_ids(0, start) + chunk.token_ids  # the proposals included
            for pos in range(start, start + chunk.num_tokens):
                self.slots[table[pos // self.block_size]][pos % self.block_size] = context[:pos + 1]
            if not chunk.sample:
                continue
            base = len(context) - k  # context[:base] ends with the sequence's last real token
            n = 0
            while n < k and self.target(context[:base + n]) == context[base + n]:
                n += 1
            tokens += [self.target(context[:base + j]) for j in range(n)] + [self.target(context[:base + n])]
            accepted.append(n)
        return StepResult(plan.step_id, tuple(tokens), num_accepted_tokens=tuple(accepted) if plan.num_spec_tokens else ())


def run(workload: list[tuple[int, list[int], int]], proposer: NgramProposer | None, *, num_blocks: int = 40,
        block_size: int = 4, budget: int = 24, prefix_caching: bool = False, abort_rng: random.Random | None = None,
        target: Target = repetitive_target, adaptive: bool = True) -> tuple[dict[int, Sequence], Scheduler]:
    """Runs ``(arrival step, prompt, max_tokens)`` requests to completion, checking the invariants each step."""
    scheduler = Scheduler(BlockAllocator(num_blocks, block_size), max_num_seqs=6, max_num_batched_tokens=budget,
                          enable_prefix_caching=prefix_caching, check_writes=True, proposer=proposer)
    workers = FakeWorkers(num_blocks, block_size, target)
    seqs: dict[int, Sequence] = {}
    step = 0
    while step < 10_000 and (scheduler.has_work() or len(seqs) < len(workload)):
        for arrival, prompt, max_tokens in workload:
            if arrival == step:
                seq = make_seq(len(seqs), prompt, max_tokens)
                if not adaptive:
                    seq.speculation = AdaptiveSpeculation(min_acceptance=0.0)
                seqs[seq.seq_id] = seq
                scheduler.add(seq)
        if abort_rng is not None and seqs and abort_rng.random() < 0.03:
            scheduler.finish(abort_rng.choice(list(seqs.values())), FinishReason.ABORT)
            scheduler.check_invariants()
        plan = scheduler.schedule()
        assert plan.num_tokens <= budget
        scheduler.check_invariants()  # the plan writes no cached or shared block
        outputs = scheduler.update(plan, workers.execute(plan, seqs))
        scheduler.check_invariants()
        for index, out in enumerate(outputs):  # nothing after a stop
            if out.finish_reason is not None:
                assert out.seq.output_token_ids[-1] == out.token_id
                assert all(later.seq is not out.seq for later in outputs[index + 1:])
        step += 1
    assert all(seq.is_finished for seq in seqs.values())
    assert scheduler.allocator.num_free_blocks == num_blocks
    return seqs, scheduler


def random_workload(seed: int, num_requests: int = 30) -> list[tuple[int, list[int], int]]:
    rng = random.Random(seed)
    motifs = [[rng.randint(3, 13) for _ in range(rng.randint(2, 5))] for _ in range(3)]
    workload = []
    for _ in range(num_requests):
        prompt = [1] + rng.choice(motifs) * rng.randint(1, 4) + [rng.randint(3, 13) for _ in range(rng.randint(0, 6))]
        workload.append((rng.randint(0, 3 * num_requests), prompt, rng.randint(1, 40)))
    return workload


def test_speculation_gives_the_same_tokens_and_keeps_every_invariant() -> None:
    for seed in range(3):
        workload = random_workload(seed)
        plain, _ = run(workload, None)
        spec, scheduler = run(workload, NgramProposer(4, 1, 3))
        assert [s.output_token_ids for s in spec.values()] == [s.output_token_ids for s in plain.values()]
        assert [s.finish_reason for s in spec.values()] == [s.finish_reason for s in plain.values()]
        stats = scheduler.spec
        assert stats.num_drafts > 50 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both outcomes
        assert stats.draft_tokens_per_pos[0] == stats.num_drafts
        assert sum(stats.accepted_tokens_per_pos) == stats.num_accepted_tokens
        assert all(s.num_output_tokens <= s.stop.max_tokens for s in spec.values())


def test_rejections_with_prefix_caching_preemption_and_aborts() -> None:
    """A small pool (preemptions), shared prompts (prefix cache hits), random aborts: invariants hold."""
    for seed in range(3):
        workload = random_workload(10 + seed, num_requests=40)
        seqs, scheduler = run(workload, NgramProposer(3, 1, 2), num_blocks=24, prefix_caching=True,
                              abort_rng=random.Random(seed))
        assert scheduler.num_preemptions > 0 and scheduler.prefix_cache_hits > 0
        assert scheduler.spec.num_drafts > 0 and scheduler.spec.num_accepted_tokens < scheduler.spec.num_draft_tokens


def test_a_stop_token_among_accepted_tokens_ends_the_sequence_there() -> None:
    """Stop token id 7 is proposed and accepted in the middle of a run: the tokens after it are dropped."""
    scheduler = Scheduler(BlockAllocator(16, 4), max_num_seqs=4, max_num_batched_tokens=32,
                          check_writes=True, proposer=NgramProposer(5, 1, 3))
    workers = FakeWorkers(16, 4, lambda context: (5, 6, 7)[len(context) % 3])
    seq = Sequence(0, [5, 6, 7, 5, 6, 7, 5], SamplingParams(temperature=0.0),
                   StopParams(30, frozenset({EOS}), frozenset({7})), 96)
    scheduler.add(seq)
    outputs = []
    while scheduler.has_work():
        plan = scheduler.schedule()
        outputs += scheduler.update(plan, workers.execute(plan, {0: seq}))
        scheduler.check_invariants()
    assert seq.output_token_ids == [6, 7] and seq.finish_reason is FinishReason.STOP
    assert [(o.token_id, o.finish_reason) for o in outputs] == [(6, None), (7, FinishReason.STOP)]
    # The second step proposed 7 5 6 7 5 ... after 6 and the target agreed: 7 was an accepted proposal.
    assert scheduler.spec.num_drafts == 1 and scheduler.spec.num_accepted_tokens >= 1
    # Only 7 was kept: the proposals the target also accepted after it were thrown away at the stop, so
    # they count as drafted, not accepted (they were once counted as accepted).
    assert scheduler.spec.num_draft_tokens > 1 and scheduler.spec.num_accepted_tokens == 1
    assert scheduler.spec.accepted_tokens_per_pos == [1] + [0] * (len(scheduler.spec.accepted_tokens_per_pos) - 1)
    assert scheduler.allocator.num_free_blocks == 16


def test_max_tokens_caps_the_proposals() -> None:
    seqs, scheduler = run([(0, [5, 6, 5, 6, 5, 6], 5)], NgramProposer(8, 1, 2),
                          target=lambda context: (5, 6)[len(context) % 2])
    (seq,) = seqs.values()
    assert seq.output_token_ids == [5, 6, 5, 6, 5] and seq.finish_reason is FinishReason.LENGTH
    # One proposal of 3 (5 6 5 after the first 5: all accepted) and the 5th token sampled, not 8.
    assert scheduler.spec.num_drafts == 1 and scheduler.spec.num_draft_tokens == 3


def test_poor_acceptance_pauses_speculation_for_the_sequence() -> None:
    # Non-repetitive text (pseudo-random by position): single-token matches abound, proposals fail.
    def target(context: tuple[int, ...]) -> int:
        return random.Random(len(context)).randint(3, 40)

    seqs, scheduler = run([(0, [5, 6, 5, 6, 5], 80)], NgramProposer(4, 1, 2), target=target)
    (seq,) = seqs.values()
    assert seq.num_output_tokens == 80
    _, unpaused = run([(0, [5, 6, 5, 6, 5], 80)], NgramProposer(4, 1, 2), target=target, adaptive=False)
    # Without the pauses it proposes at most steps; with them, a few times per doubling pause.
    assert scheduler.spec.num_drafts < 20 < unpaused.spec.num_drafts, (scheduler.spec, unpaused.spec)
    assert seq.speculation.pause > 16  # paused more than once


def test_no_proposals_in_a_batch_larger_than_the_limit() -> None:
    scheduler = Scheduler(BlockAllocator(32, 4), max_num_seqs=4, max_num_batched_tokens=64,
                          proposer=NgramProposer(3, 1, 2), disable_speculation_above=2)
    workers = FakeWorkers(32, 4, lambda context: (5, 6)[len(context) % 2])
    seqs = {i: make_seq(i, [5, 6, 5, 6, 5], 40) for i in range(3)}
    seen = set()
    for step in range(40):
        if step in (0, 2):  # two requests, then a third joins
            for seq in list(seqs.values())[:2] if step == 0 else [seqs[2]]:
                scheduler.add(seq)
        num_running = len(scheduler.running)
        plan = scheduler.schedule()
        speculating = any(c.num_spec_tokens for c in plan.scheduled)
        seen.add((num_running, speculating))
        assert not (speculating and num_running > 2)
        scheduler.update(plan, workers.execute(plan, seqs))
        scheduler.check_invariants()
    assert (2, True) in seen and (3, False) in seen  # both sides of the limit were exercised
    assert all(seq.output_token_ids == [6, 5] * 20 for seq in seqs.values())


def test_requests_that_need_per_token_state_do_not_speculate() -> None:
    scheduler = Scheduler(BlockAllocator(16, 4), max_num_seqs=4, max_num_batched_tokens=32,
                          proposer=NgramProposer(3, 1, 2))
    prompt = [5, 6, 5, 6, 5]
    plain = make_seq(0, prompt, 10)
    penalized = make_seq(1, prompt, 10, sampling=SamplingParams(temperature=0.0, repetition_penalty=1.2))
    logprobs = make_seq(2, prompt, 10, sampling=SamplingParams(temperature=0.0, logprobs=True))
    for seq in (plain, penalized, logprobs):
        scheduler.add(seq)
    plan = scheduler.schedule()
    scheduler.update(plan, StepResult(plan.step_id, (6, 6, 6)))
    plan = scheduler.schedule()
    assert [c.num_spec_tokens for c in plan.scheduled] == [3, 0, 0]  # 6 -> proposes 5 6 5
