"""Speculative decoding's counters when a stop string cuts a verified proposal (the engine, stand-in ranks).

A stop string is matched on text, after the scheduler applied (and counted) the step's tokens: the accepted
proposals past it are thrown away, and ``tpserve:spec_decode_num_accepted_tokens`` (and ``_per_pos``) must
not count them (README: "accepted counts only tokens kept: none past a stop"); the drafted counters count
every proposed token, kept or not. Reference: the counts worked out by hand from the scripted text below.
"""

from __future__ import annotations

from coordinator.block_allocator import BlockAllocator
from coordinator.metrics import Metrics
from coordinator.ngram_proposer import NgramProposer
from coordinator.scheduler import Scheduler
from tests.coordinator.fakes import FakeRankGroup, make_engine, make_params
from tests.coordinator.overlap_engine import _run
from tpserve.step import StepPlan, StepResult

# " the cat sat on" in the embedded model's vocabulary: " the", " c", "at", " sat", " on".
CYCLE = [322, 344, 365, 973, 619]
PROMPT = [1, *CYCLE, *CYCLE]  # the n-gram proposer finds the cycle: each proposal is the target's own text
K = 4


def target(token: int) -> int:
    """The stand-in model: the cycle's next token."""
    return CYCLE[(CYCLE.index(token) + 1) % len(CYCLE)]


class VerifyingRankGroup(FakeRankGroup):
    """Verifies each chunk's proposals as the ranks do: accepted while they equal the target's tokens, then
    one more token (the target's after the last accepted one)."""

    async def _run(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        tokens: list[int] = []
        accepted: list[int] = []
        for chunk in plan.scheduled:
            if not chunk.sample:
                continue
            ids, k = chunk.token_ids, chunk.num_spec_tokens
            last = len(ids) - k - 1  # the last real token; the proposals follow it
            n = 0
            while n < k and target(ids[last + n]) == ids[last + n + 1]:
                n += 1
            tokens += [target(ids[last + j]) for j in range(n + 1)]
            accepted.append(n)
        return StepResult(plan.step_id, tuple(tokens), num_accepted_tokens=tuple(accepted) if plan.num_spec_tokens else ())


def _serve(stop: tuple[str, ...], abort_r1_at: int | None = None) -> tuple[list, Scheduler, Metrics]:
    """Runs request r0 (with ``stop``) and, with ``abort_r1_at``, r1 beside it (no stop), aborted as plan
    ``abort_r1_at`` is sent: the previous step's tokens are applied then, not yet streamed. Returns r0's
    outputs, the scheduler and the metrics."""
    scheduler = Scheduler(BlockAllocator(64, 4), max_num_seqs=8, max_num_batched_tokens=64,
                          proposer=NgramProposer(K, 1, 3))
    metrics = Metrics()
    group = VerifyingRankGroup(scheduler=scheduler)
    engine = make_engine(group=group, scheduler=scheduler, metrics=metrics)
    params = [make_params(request_id="r0", prompt=PROMPT, max_tokens=40, stop=stop)]
    if abort_r1_at is not None:
        params.append(make_params(request_id="r1", prompt=PROMPT, max_tokens=40))
        group.on_submit = lambda plan: plan.step_id == abort_r1_at and engine.abort_request("r1")
    return _run(engine, *params)[0], scheduler, metrics


def _counted(metrics: Metrics) -> tuple[float | None, ...]:
    sample = metrics.registry.get_sample_value
    return (sample("tpserve:spec_decode_num_draft_tokens_total"), sample("tpserve:spec_decode_num_accepted_tokens_total"),
            *(sample("tpserve:spec_decode_num_accepted_tokens_per_pos_total", {"position": str(p)}) for p in range(K)))


def test_accepted_proposals_past_a_stop_string_are_not_counted() -> None:
    # Output tokens: the prefill's " the", then per step 4 accepted proposals and the target's next token:
    # [" c" "at" " sat" " on" " the"], [" c" "at" ...]. "on the cat" ends at the second step's 2nd token, so
    # 8 tokens are kept: the first step's 4 accepted proposals and the second's first 2 (positions 0 and 1).
    outputs, scheduler, metrics = _serve(("on the cat",))
    assert [t for out in outputs for t in out.token_ids] == [CYCLE[0], *CYCLE[1:], CYCLE[0], CYCLE[1], CYCLE[2]]
    assert "".join(out.text for out in outputs) == " the cat sat "
    assert outputs[-1].num_completion_tokens == 8
    assert scheduler.spec.num_drafts == 2 and scheduler.spec.num_draft_tokens == 2 * K
    assert scheduler.spec.num_accepted_tokens == 4 + 2
    assert scheduler.spec.accepted_tokens_per_pos == [2, 2, 1, 1]
    assert scheduler.spec.draft_tokens_per_pos == [2, 2, 2, 2]
    assert _counted(metrics) == (8, 6, 2, 2, 1, 1)  # what /metrics says


def test_without_a_stop_string_every_accepted_proposal_counts() -> None:
    # 40 tokens: the prefill's 1, then 7 steps of 5 (4 accepted + 1) and a last of 4 (3 proposed, max_tokens).
    outputs, scheduler, metrics = _serve(())
    assert [t for out in outputs for t in out.token_ids] == [CYCLE[i % 5] for i in range(40)]
    assert (scheduler.spec.num_draft_tokens, scheduler.spec.num_accepted_tokens) == (7 * K + 3, 7 * K + 3)
    assert _counted(metrics) == (31, 31, 8, 8, 8, 7)


def test_an_abort_before_the_stop_string_is_seen_adds_no_count_taken_back_later() -> None:
    # Plan 3 is sent after step 2's tokens are applied (r0's second proposal counted 4 accepted) and before
    # they are streamed (where "on the cat" takes 2 back): r1's abort then updates the gauges, and the counters
    # must not reach /metrics yet (a counter added there could not fall again). r1 kept its 2 proposals whole.
    outputs, scheduler, metrics = _serve(("on the cat",), abort_r1_at=3)
    assert [t for out in outputs for t in out.token_ids] == [CYCLE[0], *CYCLE[1:], CYCLE[0], CYCLE[1], CYCLE[2]]
    assert (scheduler.spec.num_draft_tokens, scheduler.spec.num_accepted_tokens) == (4 * K, 6 + 2 * K)
    assert _counted(metrics) == (16, 14, 4, 4, 3, 3)
