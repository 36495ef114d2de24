"""Multi-step scheduling (``--num-scheduler-steps``; coordinator/multi_step.py): one plan, k decode steps.

The ranks are tests/coordinator/fakes.py's :class:`PagedCacheModel` (as in test_async_scheduling.py):
a simulated paged cache of token ids whose next token is a fixed function of every token the
sequence's block table holds, running a multi-step plan as worker/multi_step.py expands it. A
token fed at the wrong position, a block missing for a later step, or a block reused while a
plan still wrote it changes the tokens that follow; the reference is that function applied to
the prompt alone.
"""

from __future__ import annotations

import pytest

from coordinator.block_allocator import BlockAllocator
from coordinator.engine import Engine
from coordinator.scheduler import Scheduler
from coordinator.sequence import FinishReason, Sequence, SequenceStatus, StopParams
from tests.coordinator.fakes import FakeRankGroup, PagedCacheModel, make_engine
from tests.coordinator.paged_workload import BLOCK_SIZE, check_stop_string_and_abort, next_token, reference
from tests.coordinator.paged_workload import params as _params, run as _run, tokens_of as _tokens, workload as _workload
from tpserve.step import SamplingParams, StepResult


def _engine(steps: int, *, num_blocks: int = 64, budget: int = 64, step_s: float = 0.002,
            logprobs: bool = False) -> tuple[Engine, FakeRankGroup]:
    scheduler = Scheduler(BlockAllocator(num_blocks, BLOCK_SIZE), max_num_seqs=8, max_num_batched_tokens=budget,
                          enable_prefix_caching=True, check_writes=True, num_scheduler_steps=steps)
    ranks = FakeRankGroup(scheduler=scheduler, step_s=step_s, model=PagedCacheModel(BLOCK_SIZE, next_token),
                          logprobs=logprobs)
    return make_engine(group=ranks, scheduler=scheduler, max_model_len=256, max_queue_len=64), ranks


def _sequence(seq_id: int, prompt: list[int], max_tokens: int, max_model_len: int = 256,
              sampling: SamplingParams | None = None) -> Sequence:
    return Sequence(seq_id, prompt, sampling or SamplingParams(temperature=0.0), StopParams(max_tokens), max_model_len)


@pytest.mark.parametrize("steps", [2, 4, 8])
def test_every_sequence_matches_the_reference(steps: int) -> None:
    requests = _workload(0, 12)
    engine, ranks = _engine(steps)
    results = _run(engine, requests)
    for (_, params), outputs in zip(requests, results):
        assert _tokens(outputs) == reference(params.prompt_token_ids, params.max_tokens), params.request_id
        assert outputs[-1].finish_reason is FinishReason.LENGTH
        assert outputs[-1].num_completion_tokens == params.max_tokens
    assert ranks.model.num_multi_step_plans >= 3  # the decodes really ran several steps a plan
    # The step metrics count each of a plan's steps: the histogram's sum is the tokens the ranks ran.
    samples = {s.name: s.value for s in engine.metrics.iteration_tokens.collect()[0].samples}
    assert samples["tpserve:iteration_tokens_total_sum"] == sum(p.num_tokens * p.num_steps for p in ranks.plans)
    assert all(plan.num_steps <= steps for plan in ranks.plans)
    # k is cut to the smallest room under max_tokens: nothing is sampled past a sequence's last token.
    assert sorted(ranks.model.samples.values()) == sorted(p.max_tokens for _, p in requests)
    assert engine.scheduler.allocator.num_free_blocks == 64


def test_preemption_chunked_prefill_and_a_full_pool_stay_exact() -> None:
    """16 blocks of 4 tokens for 12 requests, 8 tokens per step: sequences are preempted and prompts
    come in chunks; a plan that lacks the blocks of k steps runs one step, as without multi-step."""
    requests = _workload(1, 12)
    engine, ranks = _engine(4, num_blocks=16, budget=8)
    results = _run(engine, requests, timeout_s=60)
    assert engine.scheduler.num_preemptions > 0
    for (_, params), outputs in zip(requests, results):
        assert _tokens(outputs) == reference(params.prompt_token_ids, params.max_tokens), params.request_id
    assert ranks.model.num_multi_step_plans > 0
    assert engine.scheduler.allocator.num_free_blocks == 16


def test_a_stop_token_inside_a_plan_keeps_only_the_tokens_before_it() -> None:
    prompts = [[1, 5, 6], [1, 7, 9, 11], [3, 4], [1, 2, 3, 4, 5, 6]]
    # Each prompt's fourth reference token is made a stop token for it: it stops after three tokens,
    # inside the 8-step plan that follows its prefill.
    stops = [frozenset({reference(p, 4)[3]}) for p in prompts]
    requests = [(0.0, _params(f"r{i}", p, 20, stop_ids=s)) for i, (p, s) in enumerate(zip(prompts, stops))]
    engine, ranks = _engine(8)
    results = _run(engine, requests)
    for (_, params), outputs in zip(requests, results):
        expected = reference(params.prompt_token_ids, 20, params.stop_token_ids)
        assert _tokens(outputs) == expected and outputs[-1].finish_reason is FinishReason.STOP
        assert outputs[-1].num_completion_tokens == len(expected) + 1  # the stop token counts in usage
    # The plan's later steps sampled tokens that nobody received.
    assert any(ranks.model.samples[seq_id] > len(reference(p, 20, s)) + 1
               for seq_id, (p, s) in enumerate(zip(prompts, stops)))
    assert engine.scheduler.allocator.num_free_blocks == 64


def test_a_stop_string_and_an_abort_inside_a_plan_leak_nothing_and_later_requests_are_exact() -> None:
    engine, ranks = _engine(4)
    check_stop_string_and_abort(engine, ranks, abort_at_step=3)


def test_each_token_of_a_plan_carries_its_own_logprobs() -> None:
    engine, ranks = _engine(4, logprobs=True)
    requests = [(0.0, _params("r0", [1, 5, 6], 11)), (0.0, _params("r1", [3, 4], 9))]
    for (_, params), outputs in zip(requests, _run(engine, requests)):
        tokens = _tokens(outputs)
        assert tokens == reference(params.prompt_token_ids, params.max_tokens)
        # The fake's logprob names the token sampled (its only candidate): a sample index off by one
        # would give a token another step's candidate.
        logprobs = [lp for out in outputs for lp in out.logprobs]
        assert [lp.top_logprobs[0].token_id for lp in logprobs] == tokens
    assert ranks.model.num_multi_step_plans > 0


def test_a_plan_is_multi_step_only_when_every_running_sequence_decodes_and_none_waits() -> None:
    scheduler = Scheduler(BlockAllocator(16, BLOCK_SIZE), 8, 64, num_scheduler_steps=4)
    a = _sequence(0, [1, 5, 6], 10)
    scheduler.add(a)
    prefill = scheduler.schedule()
    assert prefill.num_steps == 1 and prefill.scheduled[0].token_ids == (1, 5, 6)
    scheduler.update(prefill, StepResult(prefill.step_id, (7,)))
    plan = scheduler.schedule()  # a decodes; nothing waits
    assert plan.num_steps == 4
    (chunk,) = plan.scheduled
    # Positions 3 .. 6 are written: blocks for 7 tokens (2 of 4), the second new.
    assert (chunk.token_ids, chunk.start_position, len(a.block_ids)) == ((7,), 3, 2)
    scheduler.update(plan, StepResult(plan.step_id, (8, 9, 10, 11)))
    assert a.output_token_ids == [7, 8, 9, 10, 11] and a.num_computed_tokens == 7
    b = _sequence(1, [4, 4], 10)
    scheduler.add(b)
    plan = scheduler.schedule()  # b waits: one step, with b's prefill beside a's decode
    assert plan.num_steps == 1 and [c.seq_id for c in plan.scheduled] == [0, 1]
    scheduler.update(plan, StepResult(plan.step_id, (12, 13)))
    plan = scheduler.schedule()
    assert plan.num_steps == 4 and [c.start_position for c in plan.scheduled] == [8, 2]
    scheduler.check_invariants()


def test_with_every_slot_taken_a_waiting_request_stops_multi_step_only_if_it_outranks_a_running_one() -> None:
    clock = [0.0]
    scheduler = Scheduler(BlockAllocator(16, BLOCK_SIZE), 1, 64, num_scheduler_steps=4, clock=lambda: clock[0])
    a = _sequence(0, [1, 5, 6], 20)
    scheduler.add(a)
    plan = scheduler.schedule()
    scheduler.update(plan, StepResult(plan.step_id, (7,)))
    clock[0] = 1.0
    scheduler.add(_sequence(1, [4, 4], 10))  # as urgent as a, later: it waits for a's slot either way
    plan = scheduler.schedule()
    assert plan.num_steps == 4 and [c.seq_id for c in plan.scheduled] == [0]
    scheduler.update(plan, StepResult(plan.step_id, (8, 9, 10, 11)))
    urgent = _sequence(2, [3, 3], 10)
    urgent.priority = -5  # more urgent than a: it preempts a in the next plan, which is one step
    scheduler.add(urgent)
    plan = scheduler.schedule()
    assert plan.num_steps == 1 and [c.seq_id for c in plan.scheduled] == [2] and a.status is SequenceStatus.WAITING
    scheduler.check_invariants()


def test_steps_are_cut_to_the_room_left_and_to_one_without_blocks_or_with_a_grammar() -> None:
    scheduler = Scheduler(BlockAllocator(16, BLOCK_SIZE), 8, 64, num_scheduler_steps=8)
    a, b = _sequence(0, [1, 5, 6], 4), _sequence(1, [1, 7], 10, max_model_len=6)
    for seq in (a, b):
        scheduler.add(seq)
    plan = scheduler.schedule()
    scheduler.update(plan, StepResult(plan.step_id, (7, 8)))
    # a may make 3 more tokens (max_tokens 4), b 3 (max_model_len 6 less its 3): 3 steps.
    plan = scheduler.schedule()
    assert plan.num_steps == 3
    scheduler.update(plan, StepResult(plan.step_id, (9, 10, 11, 12, 13, 14)))
    assert a.is_finished and b.is_finished and a.finish_reason is b.finish_reason is FinishReason.LENGTH
    assert scheduler.allocator.num_free_blocks == 16
    # A pool without the blocks of 8 steps for both: one step (which takes what it needs).
    tight = Scheduler(BlockAllocator(3, BLOCK_SIZE), 8, 64, num_scheduler_steps=8)
    c, d = _sequence(2, [1, 5, 6], 20), _sequence(3, [1, 7], 20)
    for seq in (c, d):
        tight.add(seq)
    plan = tight.schedule()
    tight.update(plan, StepResult(plan.step_id, (7, 8)))
    assert tight.schedule().num_steps == 1
    # A sequence that follows a grammar: one step (its matcher must not run past a stop).
    grammar = Scheduler(BlockAllocator(16, BLOCK_SIZE), 8, 64, num_scheduler_steps=8)
    e = _sequence(4, [1, 5], 20, sampling=SamplingParams(temperature=0.0, grammar='{"grammars": []}'))
    grammar.add(e)
    plan = grammar.schedule()
    grammar.update(plan, StepResult(plan.step_id, (7,)))
    assert grammar.schedule().num_steps == 1


def test_a_result_with_the_wrong_number_of_tokens_is_refused() -> None:
    scheduler = Scheduler(BlockAllocator(16, BLOCK_SIZE), 8, 64, num_scheduler_steps=4)
    scheduler.add(_sequence(0, [1, 5, 6], 10))
    plan = scheduler.schedule()
    scheduler.update(plan, StepResult(plan.step_id, (7,)))
    plan = scheduler.schedule()
    assert plan.num_steps == 4
    with pytest.raises(ValueError, match="3 tokens for 1 samples"):
        scheduler.update(plan, StepResult(plan.step_id, (8, 9, 10)))


@pytest.mark.parametrize("options, message", [
    (dict(num_scheduler_steps=0), "needs at least 1"),
    (dict(num_scheduler_steps=4, async_scheduling=True), "1 with async scheduling"),
])
def test_the_scheduler_refuses_what_multi_step_does_not_combine_with(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Scheduler(BlockAllocator(16, BLOCK_SIZE), 8, 64, **options)
