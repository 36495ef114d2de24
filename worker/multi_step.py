"""Multi-step plans on the ranks: one plan, ``num_steps`` decode steps (``--num-scheduler-steps``).

A multi-step plan (tpserve/step.py) holds only one-token decodes that sample, each with blocks
for ``num_steps`` tokens. The rank runs it once as an ordinary plan, then ``num_steps - 1``
times more as the plan async scheduling would have sent next: every chunk feeds
``PLACEHOLDER_TOKEN_ID`` one position further on, which worker/placeholders.py replaces with
the token the sampling rank drew the step before (sent to the other ranks in the same
collective). Each of those steps is therefore an ordinary step of the runner, with its
penalties' history, sampling noise drawn at ``(seed, position)`` and LoRA rows, so the
tokens are those of ``num_steps`` single steps; only the coordinator's round trip and its
per-step work are saved (vLLM 0.6's multi-step scheduling, which ran the same loop in its
worker for the same reason).

The answer has chunk i's token of step j at ``i * num_steps + j`` (consecutive per chunk, as a
verified chunk's tokens are), and so do its logprobs' ``sample_index``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from tpserve.step import PLACEHOLDER_TOKEN_ID, ScheduledChunk, StepPlan, StepResult


def check_multi_step(plan: StepPlan) -> None:
    """Refuses a multi-step plan the ranks cannot run as ``num_steps`` decode steps.

    Raises:
        ValueError: a new sequence, a chunk that is not a one-token decode that samples
            (a prompt chunk, a proposal), or no chunk at all.
    """
    chunks = plan.scheduled
    if plan.new_seqs or not chunks or not all(len(chunk.token_ids) == 1 and chunk.sample and not chunk.num_spec_tokens
                                              and not chunk.num_draft_tokens for chunk in chunks):
        raise ValueError(f"step {plan.step_id}: num_steps={plan.num_steps} needs one-token decodes that sample "
                         "and no new sequence")


def follow_on_plan(plan: StepPlan, step: int) -> StepPlan:
    """Step ``step`` (1 ..) of a multi-step ``plan``: every chunk feeds its last sample at
    ``start_position + step``, with no new block (the first step brought them all)."""
    return StepPlan(plan.step_id, scheduled=tuple(
        ScheduledChunk(chunk.seq_id, (PLACEHOLDER_TOKEN_ID,), chunk.start_position + step) for chunk in plan.scheduled))


def run_steps(plan: StepPlan, execute_once: Callable[[StepPlan], StepResult]) -> StepResult:
    """Runs a multi-step ``plan`` through ``execute_once`` (one ordinary step) and merges the answers.

    Raises:
        ValueError: as :func:`check_multi_step`, or as ``execute_once``.
    """
    check_multi_step(plan)
    k = plan.num_steps
    results = [execute_once(replace(plan, num_steps=1))]
    results += [execute_once(follow_on_plan(plan, step)) for step in range(1, k)]
    return merge_steps(plan, results)


def merge_steps(plan: StepPlan, results: list[StepResult]) -> StepResult:
    """One answer for the ``len(results)`` steps of a multi-step ``plan``: tokens and logprobs
    chunk by chunk, expert counts summed (flat ``(layer, expert, tokens)`` triples)."""
    k = len(results)
    tokens = [token for per_chunk in zip(*(r.sampled_token_ids for r in results)) for token in per_chunk]
    logprobs = sorted((replace(lp, sample_index=lp.sample_index * k + step)
                       for step, r in enumerate(results) for lp in r.logprobs), key=lambda lp: lp.sample_index)
    counts: Counter[tuple[int, int]] = Counter()
    for r in results:
        triples = r.expert_token_counts
        for i in range(0, len(triples), 3):
            counts[triples[i], triples[i + 1]] += triples[i + 2]
    return StepResult(step_id=plan.step_id, sampled_token_ids=tuple(tokens), logprobs=tuple(logprobs),
                      expert_token_counts=tuple(v for (layer, expert), n in sorted(counts.items())
                                                for v in (layer, expert, n)))
