"""Fair priority (docs/design/scheduling.md, "Priority ages"): waiting ages a request's priority, and a resumed sequence
is not preempted before its next token. Pure Python with a simulated clock; the
scheduler's invariants are checked after every step."""

from __future__ import annotations

from collections import deque

import pytest

from coordinator.block_allocator import BlockAllocator
from coordinator.priority import DEFAULT_PRIORITY_AGING_S, PriorityPolicy
from coordinator.scheduler import Scheduler
from coordinator.sequence import Sequence, SequenceStatus, StopParams
from tpserve.step import SamplingParams, StepResult

URGENT, NORMAL = -1, 0


class Clock:
    """Simulated monotonic seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_seq(seq_id: int, prompt_len: int, max_tokens: int, priority: int = NORMAL) -> Sequence:
    seq = Sequence(seq_id, list(range(10, 10 + prompt_len)), SamplingParams(temperature=0.0),
                   StopParams(max_tokens, frozenset({2})), 1024)
    seq.priority = priority
    return seq


def step(scheduler: Scheduler) -> None:
    plan = scheduler.schedule()
    scheduler.update(plan, StepResult(plan.step_id, (7,) * plan.num_samples))
    scheduler.check_invariants()


class UrgentTenant:
    """A tenant that keeps ``num_outstanding`` urgent requests going: a new one as each finishes."""

    def __init__(self, scheduler: Scheduler, num_outstanding: int, prompt_len: int, max_tokens: int) -> None:
        self.scheduler, self.num_outstanding = scheduler, num_outstanding
        self.prompt_len, self.max_tokens = prompt_len, max_tokens
        self.seqs: list[Sequence] = []
        self.next_id = 1000

    def refill(self) -> None:
        while sum(not seq.is_finished for seq in self.seqs) < self.num_outstanding:
            seq = make_seq(self.next_id, self.prompt_len, self.max_tokens, URGENT)
            self.next_id += 1
            self.seqs.append(seq)
            self.scheduler.add(seq)


# -- the ordering rule -------------------------------------------------------------------


def test_effective_priority_is_priority_minus_waited_over_the_aging_interval() -> None:
    clock = Clock()
    policy = PriorityPolicy(aging_s=10.0, clock=clock)
    normal, urgent = make_seq(0, 3, 4, NORMAL), make_seq(1, 3, 4, URGENT)
    policy.stamp(normal)
    clock.now = 4.0
    policy.stamp(urgent)
    clock.now = 9.0
    assert policy.effective_priority(normal) == pytest.approx(0 - 9.0 / 10)
    assert policy.effective_priority(urgent) == pytest.approx(-1 - 5.0 / 10)
    # The rank is the virtual arrival time: arrival + priority * aging_s.
    assert (policy.rank(normal), policy.rank(urgent)) == (0.0, -6.0)
    clock.now = 20.0
    policy.stamp(normal)  # a second stamp (a preempted sequence added back) keeps its age
    assert normal.arrival_s == 0.0
    assert DEFAULT_PRIORITY_AGING_S == 10.0


def test_ordering_by_rank_equals_ordering_by_effective_priority_at_any_time() -> None:
    clock = Clock()
    policy = PriorityPolicy(aging_s=2.5, clock=clock)
    seqs = []
    for seq_id, (arrival, priority) in enumerate([(0.0, 3), (1.0, -2), (2.0, 0), (7.5, -1), (9.0, 5), (9.0, -4)]):
        clock.now = arrival
        seq = make_seq(seq_id, 3, 4, priority)
        policy.stamp(seq)
        seqs.append(seq)
    by_rank = sorted(seqs, key=lambda s: (policy.rank(s), s.seq_id))
    for now in (9.0, 12.0, 100.0):
        assert by_rank == sorted(seqs, key=lambda s: (policy.effective_priority(s, now), s.seq_id))
    # Ranks (arrival + priority * 2.5): 7.5, -4, 2, 5, 21.5, -1: the 3 of priority 0 that came at 7.5 s
    # goes before the 0 of priority 3 that came at 0 s, and after the 2 of priority 0 that came at 2 s.
    assert [s.seq_id for s in by_rank] == [1, 5, 2, 3, 0, 4]


def test_the_queue_puts_an_aged_request_before_a_later_more_urgent_one() -> None:
    clock = Clock()
    policy = PriorityPolicy(aging_s=10.0, clock=clock)
    waiting: deque[Sequence] = deque()
    normal = make_seq(0, 3, 4, NORMAL)
    policy.stamp(normal)
    policy.enqueue(waiting, normal)
    clock.now = 5.0  # waited 5 s: effective -0.5, an urgent arrival (-1) still goes first
    early = make_seq(1, 3, 4, URGENT)
    policy.stamp(early)
    policy.enqueue(waiting, early)
    clock.now = 15.0  # waited 15 s: effective -1.5, ahead of an urgent arrival
    late = make_seq(2, 3, 4, URGENT)
    policy.stamp(late)
    policy.enqueue(waiting, late)
    assert [s.seq_id for s in waiting] == [1, 0, 2]
    assert policy.outranks(normal, late) and not policy.outranks(late, normal)


def test_strict_priority_without_aging_is_vllms_order() -> None:
    clock = Clock()
    policy = PriorityPolicy(aging_s=0.0, clock=clock)
    waiting: deque[Sequence] = deque()
    for seq_id, priority in enumerate([1, 0, 1, -3]):
        clock.now += 100.0
        seq = make_seq(seq_id, 3, 4, priority)
        policy.stamp(seq)
        policy.enqueue(waiting, seq)
    assert [s.seq_id for s in waiting] == [3, 1, 0, 2]  # (priority, arrival), however long they waited
    with pytest.raises(ValueError, match="priority_aging_seconds must be finite and >= 0"):
        PriorityPolicy(aging_s=-1.0)


def test_a_protected_sequence_is_passed_over_unless_nothing_else_can_go() -> None:
    policy = PriorityPolicy(aging_s=0.0)
    old, resumed = make_seq(0, 3, 8), make_seq(1, 3, 8)
    assert not policy.is_protected(old)  # never admitted
    policy.on_admitted(old)
    old.output_token_ids.append(7)
    resumed.output_token_ids.append(7)
    policy.on_admitted(resumed)
    assert policy.is_protected(resumed) and not policy.is_protected(old)
    assert policy.pick_victim([old, resumed], allow_protected=True) is old  # not the newest: it has not progressed
    assert policy.pick_victim([resumed], allow_protected=False) is None
    assert policy.pick_victim([resumed], allow_protected=True) is resumed  # nothing else would run
    resumed.output_token_ids.append(7)  # its next token: fair game again
    assert not policy.is_protected(resumed) and policy.pick_victim([old, resumed], allow_protected=False) is resumed


# -- starvation: one slot, a stream of urgent requests ---------------------------------------


def _admission_time_behind_an_urgent_stream(aging_s: float, horizon_s: float = 300.0) -> float | None:
    """Seconds a normal request waits for its first token behind a tenant that keeps four urgent
    requests going, with one sequence slot; each step takes 0.1 simulated seconds. None: never."""
    clock = Clock()
    scheduler = Scheduler(BlockAllocator(64, 4), max_num_seqs=1, max_num_batched_tokens=64,
                          priority_aging_s=aging_s, clock=clock)
    tenant = UrgentTenant(scheduler, num_outstanding=4, prompt_len=4, max_tokens=8)
    tenant.refill()
    clock.now = 0.05
    normal = make_seq(0, 4, max_tokens=8)
    scheduler.add(normal)
    while clock.now < horizon_s:
        clock.now += 0.1
        step(scheduler)
        if normal.num_output_tokens:
            return clock.now - 0.05
        tenant.refill()
    return None


def test_a_normal_request_is_admitted_in_bounded_time_behind_a_stream_of_urgent_ones() -> None:
    # Strict priority (vLLM's, and this server's before aging): never, in 300 simulated seconds.
    assert _admission_time_behind_an_urgent_stream(aging_s=0.0) is None
    # Aged: one priority level is 10 s of waiting; after that only the (at most four) urgent
    # requests that arrived before it go first, 8 steps of 0.1 s each.
    waited = _admission_time_behind_an_urgent_stream(aging_s=10.0)
    assert waited is not None and 10.0 <= waited <= 10.0 + 4 * 0.8 + 0.2
    waited = _admission_time_behind_an_urgent_stream(aging_s=1.0)
    assert waited is not None and 1.0 <= waited <= 1.0 + 4 * 0.8 + 0.2


def test_an_aged_running_request_is_not_preempted_by_later_urgent_arrivals() -> None:
    clock = Clock()
    scheduler = Scheduler(BlockAllocator(64, 4), max_num_seqs=1, max_num_batched_tokens=64,
                          priority_aging_s=10.0, clock=clock)
    normal = make_seq(0, 4, max_tokens=20)
    scheduler.add(normal)
    step(scheduler)
    clock.now = 10.5  # an urgent request arriving now ranks after the normal one (0 + 0 < 10.5 - 10)
    late = make_seq(1, 4, max_tokens=4, priority=URGENT)
    scheduler.add(late)
    step(scheduler)
    assert normal.status is SequenceStatus.RUNNING and normal.num_preemptions == 0
    assert late.status is SequenceStatus.WAITING
    clock.now = 10.5
    early = make_seq(2, 4, max_tokens=4, priority=-2)  # two levels: 20 s of head start, still ahead
    scheduler.add(early)
    step(scheduler)
    assert normal.status is SequenceStatus.WAITING and normal.num_preemptions == 1
    assert early.status is SequenceStatus.RUNNING


# -- preemption only after progress ------------------------------------------------------------


def _victim_under_kv_pressure(num_blocks: int, victim_prompt_len: int, num_urgent: int,
                              aging_s: float = 0.0, num_steps: int = 3000) -> Sequence:
    """A normal request with a long prompt (recomputed in chunks of 8 tokens) against a tenant
    that keeps urgent requests going, in a small KV pool (blocks of 4 tokens)."""
    clock = Clock()
    scheduler = Scheduler(BlockAllocator(num_blocks, 4), max_num_seqs=8, max_num_batched_tokens=8,
                          priority_aging_s=aging_s, clock=clock)
    tenant = UrgentTenant(scheduler, num_outstanding=num_urgent, prompt_len=4, max_tokens=12)
    tenant.refill()
    victim = make_seq(0, victim_prompt_len, max_tokens=16)
    scheduler.add(victim)
    for _ in range(num_steps):
        if victim.is_finished:
            break
        clock.now += 0.1
        step(scheduler)
        tenant.refill()
    return victim


@pytest.mark.parametrize(("num_blocks", "victim_prompt_len", "num_urgent"), [(12, 24, 2), (16, 32, 3), (12, 24, 3)])
def test_a_victim_is_preempted_at_most_once_per_token_it_produces(num_blocks, victim_prompt_len, num_urgent) -> None:
    # Before: preempted in the middle of every recompute (12 blocks, 2 urgent: 250 preemptions,
    # 1 token in 3000 steps). Now each preemption follows a token; strict priority still lets
    # the urgent tenant hold it back, which aging (next test) bounds.
    victim = _victim_under_kv_pressure(num_blocks, victim_prompt_len, num_urgent)
    assert 0 < victim.num_preemptions <= victim.num_output_tokens


def test_with_aging_the_victim_under_kv_pressure_finishes() -> None:
    victim = _victim_under_kv_pressure(12, 24, 2, aging_s=1.0)
    assert victim.is_finished and victim.num_output_tokens == 16
    assert victim.num_preemptions <= victim.num_output_tokens


def test_when_every_candidate_is_protected_the_scheduler_still_makes_progress() -> None:
    # Two sequences resumed after a worker-group restart, each mid-recompute (chunks of 4
    # tokens), in a pool that holds only one of them whole: neither has produced a token
    # since, so both are protected. The step must still run something, and both finish.
    scheduler = Scheduler(BlockAllocator(6, 2), max_num_seqs=4, max_num_batched_tokens=4, priority_aging_s=0.0)
    first, second = make_seq(0, 5, max_tokens=4), make_seq(1, 5, max_tokens=4)
    scheduler.add(first)
    scheduler.add(second)
    step(scheduler)
    step(scheduler)
    scheduler.reset_workers()
    assert all(seq.num_preemptions == 1 and seq.status is SequenceStatus.WAITING for seq in (first, second))
    num_steps = 0
    while not (first.is_finished and second.is_finished):
        plan = scheduler.schedule()
        assert plan.scheduled, "a step with nothing scheduled: the scheduler is stuck"
        scheduler.update(plan, StepResult(plan.step_id, (7,) * plan.num_samples))
        scheduler.check_invariants()
        num_steps += 1
        assert num_steps < 100
    assert first.output_token_ids == [7] * 4 and second.output_token_ids == [7] * 4
    assert scheduler.allocator.num_free_blocks == 6


def test_when_nothing_else_would_run_a_protected_sequence_is_preempted() -> None:
    # Both running sequences were just admitted (protected) and the pool is exhausted (blocks
    # taken from outside for the test): the first needs a block for its decode and nothing is
    # scheduled before it, so the newest is preempted after all rather than an empty step.
    scheduler = Scheduler(BlockAllocator(8, 2), max_num_seqs=4, max_num_batched_tokens=64, priority_aging_s=0.0)
    first, second = make_seq(0, 4, max_tokens=4), make_seq(1, 4, max_tokens=4)
    scheduler.add(first)
    scheduler.add(second)
    step(scheduler)  # both prefilled (2 blocks each) and sampled: position 4 needs a third block
    for seq in (first, second):
        scheduler.priority.on_admitted(seq)
        assert scheduler.priority.is_protected(seq)
    taken = scheduler.allocator.allocate(scheduler.allocator.num_free_blocks)
    plan = scheduler.schedule()
    assert [c.seq_id for c in plan.scheduled] == [0] and plan.finished_seq_ids == (1,)
    assert second.status is SequenceStatus.WAITING and second.num_preemptions == 1 and first.num_preemptions == 0
    scheduler.update(plan, StepResult(plan.step_id, (7,)))
    scheduler.allocator.free(taken)
    while not (first.is_finished and second.is_finished):
        step(scheduler)
    assert scheduler.allocator.num_free_blocks == 8
