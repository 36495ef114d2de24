"""Scheduler and block allocator: pure Python, no torch, invariants checked after every step."""

from __future__ import annotations

import random

import pytest

from coordinator.block_allocator import BlockAllocator, num_blocks_for
from coordinator.scheduler import Scheduler
from coordinator.sequence import FinishReason, Sequence, SequenceStatus, StopParams
from tpserve.step import SamplingParams, StepPlan, StepResult

EOS = 2


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 8, max_model_len: int = 1024) -> Sequence:
    return Sequence(seq_id, list(range(10, 10 + prompt_len)), SamplingParams(temperature=0.0),
                    StopParams(max_tokens, frozenset({EOS})), max_model_len)


def step(scheduler: Scheduler, token: int = 7) -> tuple[StepPlan, list]:
    plan = scheduler.schedule()
    outputs = scheduler.update(plan, StepResult(plan.step_id, (token,) * plan.num_samples))
    scheduler.check_invariants()
    return plan, outputs


def test_allocator_allocates_frees_and_refuses() -> None:
    allocator = BlockAllocator(4, block_size=16)
    a = allocator.allocate(3)
    assert a == [0, 1, 2] and allocator.num_free_blocks == 1
    assert allocator.allocate(2) is None and allocator.num_free_blocks == 1
    allocator.free(a)
    assert allocator.num_free_blocks == 4
    with pytest.raises(ValueError, match="freed while free"):
        allocator.free([0])
    allocator.check_invariants([])
    assert num_blocks_for(0, 16) == 0 and num_blocks_for(16, 16) == 1 and num_blocks_for(17, 16) == 2


def test_prefill_then_decode_until_max_tokens() -> None:
    scheduler = Scheduler(BlockAllocator(8, 4), max_num_seqs=4, max_num_batched_tokens=64)
    seq = make_seq(0, prompt_len=6, max_tokens=3)
    scheduler.add(seq)
    plan, outputs = step(scheduler)
    (new,) = plan.new_seqs
    (chunk,) = plan.scheduled
    assert new.seq_id == 0 and chunk.token_ids == tuple(range(10, 16)) and chunk.start_position == 0
    assert chunk.new_block_ids == (0, 1) and chunk.sample
    assert [o.token_id for o in outputs] == [7] and seq.num_computed_tokens == 6
    plan, _ = step(scheduler)
    (chunk,) = plan.scheduled
    assert plan.new_seqs == () and chunk.token_ids == (7,) and chunk.start_position == 6 and chunk.new_block_ids == ()
    plan, outputs = step(scheduler)  # position 7 -> still block 1; third token finishes
    assert outputs[0].finish_reason is FinishReason.LENGTH and seq.is_finished
    assert scheduler.allocator.num_free_blocks == 8
    plan = scheduler.schedule()
    assert plan.finished_seq_ids == (0,) and plan.scheduled == ()


def test_eos_and_stop_token_ids_finish_with_stop() -> None:
    scheduler = Scheduler(BlockAllocator(8, 4), max_num_seqs=4, max_num_batched_tokens=64)
    seq = make_seq(0, 3, max_tokens=10)
    scheduler.add(seq)
    _, outputs = step(scheduler, token=EOS)
    assert outputs[0].finish_reason is FinishReason.STOP and seq.stopped_on_token()
    ignoring = Sequence(1, [5, 6], SamplingParams(), StopParams(10, frozenset({EOS}), frozenset({9}), ignore_eos=True), 64)
    scheduler.add(ignoring)
    _, outputs = step(scheduler, token=EOS)
    assert outputs[0].finish_reason is None
    _, outputs = step(scheduler, token=9)
    assert outputs[0].finish_reason is FinishReason.STOP and ignoring.output_token_ids == [EOS, 9]


def test_context_length_finishes_with_length() -> None:
    scheduler = Scheduler(BlockAllocator(8, 4), max_num_seqs=4, max_num_batched_tokens=64)
    seq = make_seq(0, prompt_len=5, max_tokens=100, max_model_len=7)
    scheduler.add(seq)
    step(scheduler)
    _, outputs = step(scheduler)
    assert outputs[0].finish_reason is FinishReason.LENGTH and seq.num_tokens == 7


def test_chunked_prefill_respects_token_budget() -> None:
    scheduler = Scheduler(BlockAllocator(16, 4), max_num_seqs=4, max_num_batched_tokens=5)
    seq = make_seq(0, prompt_len=12)
    scheduler.add(seq)
    plans = [step(scheduler)[0] for _ in range(3)]
    assert [p.scheduled[0].start_position for p in plans] == [0, 5, 10]
    assert [p.scheduled[0].num_tokens for p in plans] == [5, 5, 2]
    assert [p.scheduled[0].sample for p in plans] == [False, False, True]
    assert seq.output_token_ids == [7]


def test_new_request_joins_running_batch_at_next_step() -> None:
    scheduler = Scheduler(BlockAllocator(16, 4), max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add(make_seq(0, 4))
    step(scheduler)
    scheduler.add(make_seq(1, 3))
    plan, outputs = step(scheduler)
    assert [c.seq_id for c in plan.scheduled] == [0, 1] and [c.num_tokens for c in plan.scheduled] == [1, 3]
    assert [n.seq_id for n in plan.new_seqs] == [1] and len(outputs) == 2


def test_admission_waits_for_blocks_and_max_num_seqs() -> None:
    scheduler = Scheduler(BlockAllocator(4, 4), max_num_seqs=1, max_num_batched_tokens=64)
    first, second = make_seq(0, 4, max_tokens=2), make_seq(1, 4, max_tokens=2)
    scheduler.add(first)
    scheduler.add(second)
    plan, _ = step(scheduler)
    assert [c.seq_id for c in plan.scheduled] == [0]  # max_num_seqs=1
    step(scheduler)  # first finishes
    plan, _ = step(scheduler)
    assert [c.seq_id for c in plan.scheduled] == [1] and plan.finished_seq_ids == (0,)


def test_preemption_recomputes_the_newest_sequence() -> None:
    # 4 blocks of 2 tokens: two 3-token prompts take 2 blocks each; the first decode that
    # crosses a block boundary must preempt the newer sequence.
    scheduler = Scheduler(BlockAllocator(4, 2), max_num_seqs=4, max_num_batched_tokens=64)
    old, new = make_seq(0, 3, max_tokens=4), make_seq(1, 3, max_tokens=4)
    scheduler.add(old)
    scheduler.add(new)
    step(scheduler)  # both prefilled (4 blocks), each sampled one token -> 4 tokens each
    plan, _ = step(scheduler)  # decode position 3 fits in block 1 for both
    assert [c.seq_id for c in plan.scheduled] == [0, 1]
    plan, _ = step(scheduler)  # position 4 needs a third block each: preempt the newest
    assert [c.seq_id for c in plan.scheduled] == [0] and plan.finished_seq_ids == (1,)  # dropped before reuse
    assert new.status is SequenceStatus.WAITING and new.num_preemptions == 1 and not new.block_ids
    while not old.is_finished:
        step(scheduler)
    plan, _ = step(scheduler)  # the preempted one comes back as new, with all its tokens
    assert plan.finished_seq_ids == (0,)
    assert [n.seq_id for n in plan.new_seqs] == [1]
    assert plan.scheduled[0].start_position == 0 and plan.scheduled[0].num_tokens == 3 + 2


def test_priority_orders_the_queue_and_picks_the_preemption_victim() -> None:
    """Lower values first (vLLM's convention): a later high-priority request overtakes waiting
    low-priority ones, and under KV pressure the low-priority sequence is preempted, not the newest."""
    scheduler = Scheduler(BlockAllocator(64, 2), max_num_seqs=1, max_num_batched_tokens=64)
    lows = [make_seq(i, 3, max_tokens=1) for i in range(4)]
    for seq in lows:
        seq.priority = 1
        scheduler.add(seq)
    high = make_seq(4, 3, max_tokens=1)
    scheduler.add(high)
    admitted = [step(scheduler)[0].new_seqs[0].seq_id for _ in range(5)]
    assert admitted == [4, 0, 1, 2, 3]

    scheduler = Scheduler(BlockAllocator(4, 2), max_num_seqs=4, max_num_batched_tokens=64)
    low, high = make_seq(0, 3, max_tokens=4), make_seq(1, 3, max_tokens=4)
    low.priority = 1
    scheduler.add(low)
    scheduler.add(high)
    step(scheduler)
    step(scheduler)
    plan, _ = step(scheduler)  # both need a third block: the low-priority (older) one goes
    assert [c.seq_id for c in plan.scheduled] == [1] and plan.finished_seq_ids == (0,)
    assert low.status is SequenceStatus.WAITING and low.num_preemptions == 1 and high.num_preemptions == 0


def test_a_waiting_high_priority_sequence_preempts_lower_priority_running_ones() -> None:
    # 5 blocks of 2 tokens, 4 held by two running low-priority sequences: a high-priority
    # arrival that needs 2 blocks preempts the newer of them and runs in the same step.
    scheduler = Scheduler(BlockAllocator(5, 2), max_num_seqs=4, max_num_batched_tokens=64)
    lows = [make_seq(i, 3, max_tokens=8) for i in range(2)]
    for seq in lows:
        seq.priority = 1
        scheduler.add(seq)
    step(scheduler)
    high = make_seq(2, 3, max_tokens=8)
    scheduler.add(high)
    plan, _ = step(scheduler)
    assert [c.seq_id for c in plan.scheduled] == [0, 2] and plan.finished_seq_ids == (1,)
    assert lows[1].status is SequenceStatus.WAITING and lows[0].num_preemptions == 0
    # An equal priority waits its turn, and so does one that no preemption could make room for.
    equal = make_seq(3, 3)
    equal.priority = 1
    scheduler.add(equal)
    scheduler.add(make_seq(4, 40))
    plan, _ = step(scheduler)
    assert [c.seq_id for c in plan.scheduled] == [0, 2] and scheduler.num_preemptions == 1
    # max_num_seqs 1: the slot itself goes to the higher priority.
    scheduler = Scheduler(BlockAllocator(64, 2), max_num_seqs=1, max_num_batched_tokens=64)
    low = make_seq(0, 3, max_tokens=8)
    low.priority = 5
    scheduler.add(low)
    step(scheduler)
    scheduler.add(make_seq(1, 3, max_tokens=8))
    plan, _ = step(scheduler)
    assert [n.seq_id for n in plan.new_seqs] == [1] and low.status is SequenceStatus.WAITING


def test_finish_frees_blocks_at_once_and_drops_late_tokens() -> None:
    scheduler = Scheduler(BlockAllocator(8, 4), max_num_seqs=4, max_num_batched_tokens=64)
    seq = make_seq(0, 5)
    scheduler.add(seq)
    plan = scheduler.schedule()
    scheduler.finish(seq, FinishReason.ABORT)  # cancelled while the step runs
    assert scheduler.allocator.num_free_blocks == 8
    assert scheduler.update(plan, StepResult(plan.step_id, (7,))) == []
    scheduler.check_invariants()
    waiting = make_seq(1, 5)
    scheduler.add(waiting)
    scheduler.finish(waiting, FinishReason.ABORT)  # cancelled while queued
    assert not scheduler.waiting
    plan = scheduler.schedule()
    assert plan.finished_seq_ids == (0,)  # only the one the workers knew


def test_update_rejects_a_result_of_the_wrong_length() -> None:
    scheduler = Scheduler(BlockAllocator(8, 4), max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add(make_seq(0, 3))
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match="0 tokens for 1 samples"):
        scheduler.update(plan, StepResult(plan.step_id, ()))


def test_random_workload_never_leaks_blocks() -> None:
    rng = random.Random(0)
    scheduler = Scheduler(BlockAllocator(24, 4), max_num_seqs=6, max_num_batched_tokens=40)
    seqs = []
    for _ in range(400):
        if rng.random() < 0.3:
            seq = make_seq(len(seqs), rng.randint(1, 30), max_tokens=rng.randint(1, 20), max_model_len=64)
            seqs.append(seq)
            scheduler.add(seq)
        if seqs and rng.random() < 0.05:
            scheduler.finish(rng.choice(seqs), FinishReason.ABORT)
        if scheduler.running or scheduler.waiting:
            step(scheduler, token=EOS if rng.random() < 0.05 else 7)
    while scheduler.running or scheduler.waiting:
        step(scheduler)
    assert all(seq.is_finished for seq in seqs)
    assert scheduler.allocator.num_free_blocks == 24 and scheduler.num_preemptions > 0


def test_random_workload_with_priorities_never_leaks_blocks_or_hangs() -> None:
    rng = random.Random(1)
    scheduler = Scheduler(BlockAllocator(24, 4), max_num_seqs=4, max_num_batched_tokens=40)
    seqs = []
    for _ in range(400):
        if rng.random() < 0.3:
            seq = make_seq(len(seqs), rng.randint(1, 30), max_tokens=rng.randint(1, 20), max_model_len=64)
            seq.priority = rng.randint(-2, 2)
            seqs.append(seq)
            scheduler.add(seq)
        if seqs and rng.random() < 0.05:
            scheduler.finish(rng.choice(seqs), FinishReason.ABORT)
        if scheduler.running or scheduler.waiting:
            step(scheduler, token=EOS if rng.random() < 0.05 else 7)
        assert [(s.priority, s.seq_id) for s in scheduler.waiting] == \
            sorted((s.priority, s.seq_id) for s in scheduler.waiting)
    for _ in range(2000):
        if not (scheduler.running or scheduler.waiting):
            break
        step(scheduler)
    assert all(seq.is_finished for seq in seqs)
    assert scheduler.allocator.num_free_blocks == 24 and scheduler.num_preemptions > 0
