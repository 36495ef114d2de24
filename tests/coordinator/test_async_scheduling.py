"""Async scheduling (``--async-scheduling``; docs/design/scheduling.md, "Async scheduling"): step t+1 is planned and
sent before step t's result.

The worker group here is the one fake (tests/coordinator/fakes.py ``FakeRankGroup``) running a
:class:`~tests.coordinator.fakes.PagedCacheModel`: a simulation of the ranks' bookkeeping, not
canned tokens. It runs plans strictly in order, keeps a paged "KV cache" of token ids and the
block tables from the plans, resolves placeholders, and samples each sequence's next token as
:func:`next_token` of every token its block table holds. A token fed at the wrong position, a
placeholder resolved to the wrong token, a block reused while a step in flight still wrote it,
or a stale prefix-cache hit all change the tokens that follow. The reference is that same
function applied to the prompt alone (:func:`reference`), with no engine, scheduler or blocks.
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.block_allocator import BlockAllocator
from coordinator.engine import Engine
from coordinator.engine_state import EngineState
from coordinator.ngram_proposer import NgramProposer
from coordinator.scheduler import Scheduler
from coordinator.sequence import FinishReason, Sequence, StopParams
from coordinator.worker_client import WorkerGroupError
from tests.coordinator.fakes import FakeRankGroup, PagedCacheModel, make_engine
from tpserve.step import PLACEHOLDER_TOKEN_ID, SamplingParams, StepPlan, StepResult

from tests.coordinator.paged_workload import BLOCK_SIZE, check_stop_string_and_abort, next_token, reference
from tests.coordinator.paged_workload import params as _params, run as _run, tokens_of as _tokens, workload as _workload


def _ranks(scheduler: Scheduler, step_s: float = 0.002) -> FakeRankGroup:
    return FakeRankGroup(scheduler=scheduler, step_s=step_s, model=PagedCacheModel(BLOCK_SIZE, next_token))


def _engine(*, async_scheduling: bool, num_blocks: int = 64, budget: int = 64, prefix_caching: bool = True,
            step_s: float = 0.002) -> tuple[Engine, FakeRankGroup]:
    scheduler = Scheduler(BlockAllocator(num_blocks, BLOCK_SIZE), max_num_seqs=8, max_num_batched_tokens=budget,
                          enable_prefix_caching=prefix_caching, check_writes=True, async_scheduling=async_scheduling)
    ranks = _ranks(scheduler, step_s)
    return make_engine(group=ranks, scheduler=scheduler, max_model_len=256, max_queue_len=64), ranks


def test_every_sequence_matches_the_reference_with_two_steps_in_flight() -> None:
    requests = _workload(0, 12)
    engine, ranks = _engine(async_scheduling=True)
    results = _run(engine, requests)
    for (_, params), outputs in zip(requests, results):
        assert _tokens(outputs) == reference(params.prompt_token_ids, params.max_tokens), params.request_id
        assert outputs[-1].finish_reason is FinishReason.LENGTH
        assert outputs[-1].num_completion_tokens == params.max_tokens
    assert ranks.model.num_placeholders > 100  # the decodes really fed the ranks' own tokens
    # A sequence finished by length is never planned past its last token: nothing sampled is wasted.
    assert sorted(ranks.model.samples.values()) == sorted(p.max_tokens for _, p in requests)
    assert engine.scheduler.allocator.num_free_blocks == 64


def test_preemption_chunked_prefill_and_a_full_pool_stay_exact() -> None:
    """16 blocks of 4 tokens for 12 requests, 8 tokens per step: sequences are preempted with
    tokens pending (those are dropped and recomputed), prompts come in chunks."""
    requests = _workload(1, 12)
    engine, ranks = _engine(async_scheduling=True, num_blocks=16, budget=8)
    results = _run(engine, requests, timeout_s=60)
    assert engine.scheduler.num_preemptions > 0
    for (_, params), outputs in zip(requests, results):
        assert _tokens(outputs) == reference(params.prompt_token_ids, params.max_tokens), params.request_id
    assert engine.scheduler.allocator.num_free_blocks == 16


def test_a_stop_token_ends_a_sequence_whose_next_two_steps_are_in_flight() -> None:
    prompts = [[1, 5, 6], [1, 7, 9, 11], [3, 4], [1, 2, 3, 4, 5, 6]]
    # Each prompt's third reference token is made a stop token for it: it stops after two tokens.
    stops = [frozenset({reference(p, 3)[2]}) for p in prompts]
    requests = [(0.0, _params(f"r{i}", p, 20, stop_ids=s)) for i, (p, s) in enumerate(zip(prompts, stops))]
    engine, ranks = _engine(async_scheduling=True)
    results = _run(engine, requests)
    for (_, params), outputs in zip(requests, results):
        expected = reference(params.prompt_token_ids, 20, params.stop_token_ids)
        assert _tokens(outputs) == expected and outputs[-1].finish_reason is FinishReason.STOP
    # The step already planned after the stop sampled a token that nobody received.
    assert any(ranks.model.samples[seq_id] > len(reference(p, 20, s)) + 1
               for seq_id, (p, s) in enumerate(zip(prompts, stops)))
    assert engine.scheduler.allocator.num_free_blocks == 64


def test_a_stop_string_and_an_abort_with_steps_in_flight_leak_nothing_and_later_requests_are_exact() -> None:
    engine, ranks = _engine(async_scheduling=True)
    check_stop_string_and_abort(engine, ranks, abort_at_step=5)


def test_the_ranks_find_the_next_plan_sent_before_the_previous_result_is_taken() -> None:
    engine, ranks = _engine(async_scheduling=True, step_s=0.005)
    taken: list[int] = []
    original = engine.scheduler.update

    def update(plan, result):
        taken.append(plan.step_id)
        ranks.events.append(("taken", plan.step_id))
        return original(plan, result)

    engine.scheduler.update = update
    (outputs,) = _run(engine, [(0.0, _params("r0", [1, 5, 6, 8], 8))])
    assert _tokens(outputs) == reference([1, 5, 6, 8], 8)
    events = ranks.events
    # Every step but the last is followed by the next plan's submission before its result is taken,
    # so a rank ends step t with step t+1 queued.
    for step_id in taken[:-1]:
        assert events.index(("submit", step_id + 1)) < events.index(("taken", step_id)), events
    # Without async scheduling the next plan is sent only after the result is taken.
    engine, ranks = _engine(async_scheduling=False, step_s=0.005)
    engine.scheduler.update = lambda plan, result, original=engine.scheduler.update: (
        ranks.events.append(("taken", plan.step_id)), original(plan, result))[1]
    _run(engine, [(0.0, _params("r0", [1, 5, 6, 8], 8))])
    assert ranks.events.index(("submit", 1)) > ranks.events.index(("taken", 0))
    assert ranks.model.num_placeholders == 0


def test_a_group_failure_with_two_steps_in_flight_restarts_and_every_request_is_exact() -> None:
    engine, lost = _engine(async_scheduling=True)
    scheduler = engine.scheduler
    new = _ranks(scheduler)
    original = lost.model.execute

    def failing(plan: StepPlan) -> list[int]:
        if plan.step_id >= 6:  # this step and every later one of the lost group (WorkerGroup.failed)
            raise WorkerGroupError(f"step {plan.step_id}: rank 1 is gone")
        return original(plan)

    lost.model.execute = failing  # type: ignore[method-assign]

    def on_failure(reason: str) -> bool:  # as launch/recovery.py: suspend at once, resume once restarted
        engine.suspend(reason)
        asyncio.get_running_loop().call_later(0.01, engine.resume, new)
        return True

    engine.loop.on_group_failure = on_failure
    requests = [(0.0, _params(f"r{i}", [1, 5 + i, 6], 10 + i)) for i in range(4)]
    results = _run(engine, requests)
    for (_, params), outputs in zip(requests, results):
        assert _tokens(outputs) == reference(params.prompt_token_ids, params.max_tokens)
    assert engine.state is EngineState.SERVING and scheduler.allocator.num_free_blocks == 64
    assert new.model.num_placeholders > 0


def test_without_async_scheduling_no_plan_has_a_placeholder_and_the_tokens_are_the_same() -> None:
    requests = _workload(2, 10)
    engine, ranks = _engine(async_scheduling=False, num_blocks=16, budget=8)
    results = _run(engine, requests, timeout_s=60)
    for (_, params), outputs in zip(requests, results):
        assert _tokens(outputs) == reference(params.prompt_token_ids, params.max_tokens)
    assert ranks.model.num_placeholders == 0


def _sequence(seq_id: int, prompt: list[int], max_tokens: int, max_model_len: int = 256) -> Sequence:
    return Sequence(seq_id, prompt, SamplingParams(temperature=0.0), StopParams(max_tokens), max_model_len)


def test_a_planned_sample_is_pending_and_the_next_plan_decodes_its_placeholder() -> None:
    scheduler = Scheduler(BlockAllocator(16, BLOCK_SIZE), 8, 64, async_scheduling=True)
    a, b = _sequence(0, [1, 5, 6], 10), _sequence(1, [1, 7], 10, max_model_len=4)
    scheduler.add(a)
    scheduler.add(b)
    first = scheduler.schedule()
    assert [(c.token_ids, c.start_position, c.sample) for c in first.scheduled] == [((1, 5, 6), 0, True),
                                                                                   ((1, 7), 0, True)]
    assert (a.num_computed_tokens, a.num_pending_tokens, b.num_pending_tokens) == (3, 1, 1)
    second = scheduler.schedule()  # before the first's result
    assert [(c.seq_id, c.token_ids, c.start_position, c.sample) for c in second.scheduled] == \
        [(0, (PLACEHOLDER_TOKEN_ID,), 3, True), (1, (PLACEHOLDER_TOKEN_ID,), 2, True)]
    assert a.num_pending_tokens == 2
    # b's token after the second step is its last (4 positions): the third plan leaves it out.
    third_before_results = scheduler.schedule()
    assert [c.seq_id for c in third_before_results.scheduled] == [0]
    outputs = scheduler.update(first, StepResult(first.step_id, (40, 41)))
    assert [(o.seq.seq_id, o.token_id, o.finish_reason) for o in outputs] == [(0, 40, None), (1, 41, None)]
    assert a.output_token_ids == [40] and a.num_pending_tokens == 2 and a.num_computed_tokens == 5
    scheduler.update(second, StepResult(second.step_id, (42, 43)))
    assert b.is_finished and b.finish_reason is FinishReason.LENGTH and b.output_token_ids == [41, 43]
    scheduler.check_invariants()


def test_a_plan_that_schedules_nothing_gives_its_drops_to_the_next() -> None:
    scheduler = Scheduler(BlockAllocator(16, BLOCK_SIZE), 8, 64, async_scheduling=True)
    a, b = _sequence(0, [1, 5, 6], 1), _sequence(1, [1, 7], 10)
    scheduler.add(a)
    scheduler.add(b)
    first = scheduler.schedule()
    scheduler.finish(b, FinishReason.ABORT)
    empty = scheduler.schedule()  # a's pending token is its last; b is gone
    assert not empty.scheduled and empty.finished_seq_ids == (1,)
    scheduler.take_back(empty)
    scheduler.update(first, StepResult(first.step_id, (40, 41)))
    scheduler.add(_sequence(2, [3, 3], 2))
    assert scheduler.schedule().finished_seq_ids == (1, 0)


def test_async_scheduling_and_a_proposer_are_refused_together() -> None:
    with pytest.raises(ValueError, match="speculative decoding"):
        Scheduler(BlockAllocator(16, BLOCK_SIZE), 8, 64, proposer=NgramProposer(2, 1, 3), async_scheduling=True)


def test_an_abort_that_leaves_the_plan_ahead_empty_still_reaches_the_workers() -> None:
    """r1 is aborted as the first step leaves; r0's only token is pending: the plan made then has
    nothing to run and is not sent, and the workers learn of r1 from the next plan that is."""
    engine, ranks = _engine(async_scheduling=True)

    def abort_r1(plan: StepPlan) -> None:
        if plan.step_id == 0:
            assert engine.abort_request("r1") == 1

    ranks.on_submit = abort_r1
    first = [(0.0, _params("r0", [1, 5, 6], 1)), (0.0, _params("r1", [1, 7], 10))]
    second = [(0.0, _params("s0", [2, 3], 3))]
    only, aborted, later = _run(engine, first, second)
    assert _tokens(only) == reference([1, 5, 6], 1) and aborted[-1].finish_reason is FinishReason.ABORT
    assert _tokens(later) == reference([2, 3], 3)
    assert set(ranks.model.tables) == {2}  # r0 and r1 dropped; s0's drop goes with a plan yet to come


def test_blocks_filled_by_steps_applied_late_still_enter_the_prefix_cache() -> None:
    """The sequence's count of computed tokens runs ahead of the results under async scheduling; the
    blocks each applied step filled are cached all the same, and a later prompt sharing them hits."""
    engine, ranks = _engine(async_scheduling=True)
    shared = [1, 5, 6, 8, 9, 10, 11, 12]  # two blocks of 4
    first, second = _run(engine, [(0.0, _params("a", shared + [13], 6))], [(0.0, _params("b", shared + [14], 6))])
    assert _tokens(first) == reference(shared + [13], 6) and _tokens(second) == reference(shared + [14], 6)
    assert second[-1].num_cached_prompt_tokens == 8
