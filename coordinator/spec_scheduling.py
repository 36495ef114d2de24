"""Speculative decoding's part of scheduling: proposals for a decode, and applying a verified chunk.

Beside coordinator/spec_decode.py (the per-sequence switch-off and the counters); the
scheduler (coordinator/scheduler.py) calls these only with a proposer configured, so
nothing here runs per token when speculation is off. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.kv_cache_manager import KVCacheManager
from coordinator.ngram_proposer import DraftModelProposer, NgramProposer
from coordinator.sequence import FinishReason, Sequence
from coordinator.spec_decode import SpecDecodeStats
from tpserve.step import SampleLogprobs, ScheduledChunk, StepPlan, StepResult


@dataclass(slots=True)  # not frozen: a frozen slots dataclass's __init__ costs 4x (one per token: request-path.md)
class TokenOutput:
    """One sampled token for one sequence, why the sequence stopped (if it did), its logprobs (if asked);
    not changed once made."""

    seq: Sequence
    token_id: int
    finish_reason: FinishReason | None
    logprobs: SampleLogprobs | None = None


def propose(proposer: NgramProposer | DraftModelProposer | None, seq: Sequence, room: int) -> tuple[tuple[int, ...], int]:
    """``(proposed tokens, tokens the draft model will propose)`` after ``seq``'s last one, at most
    ``room`` in all (none when it may not speculate)."""
    if proposer is None or room <= 0 or not seq.sampling.allows_speculation \
            or not seq.speculation.allowed(seq.num_output_tokens):
        return (), 0
    # Every accepted token and the one sampled after them must fit max_tokens and max_model_len.
    room = min(room, seq.stop.max_tokens - seq.num_output_tokens - 1, seq.max_model_len - seq.num_tokens - 1)
    if room <= 0:
        return (), 0
    if isinstance(proposer, DraftModelProposer):  # the workers' draft model proposes
        return (), proposer.num_to_propose(room)
    return proposer.propose(seq.token_ids(0, seq.num_tokens), room), 0


def tokens_per_sample(plan: StepPlan, result: StepResult) -> list[int]:
    """How many tokens each sample of ``plan`` gave in ``result`` (1 plus its accepted proposals;
    ``plan.num_steps`` for a multi-step plan).

    Raises:
        ValueError: the result does not carry one token per sample plus the accepted
            proposals, or accepts more proposals than a chunk had.
    """
    accepted = result.num_accepted_tokens
    samples = [chunk for chunk in plan.scheduled if chunk.sample]
    if accepted and len(accepted) != len(samples) or (not accepted and plan.num_spec_tokens):
        raise ValueError(f"step {plan.step_id}: {len(accepted)} acceptance counts for {len(samples)} samples")
    counts = [plan.num_steps + (accepted[i] if accepted else 0) for i in range(len(samples))]
    if any(count - plan.num_steps > chunk.num_spec_tokens + chunk.num_draft_tokens
           for count, chunk in zip(counts, samples)):
        raise ValueError(f"step {plan.step_id}: more proposals accepted than proposed")
    if len(result.sampled_token_ids) != sum(counts):
        raise ValueError(f"step {plan.step_id}: {len(result.sampled_token_ids)} tokens for "
                         f"{plan.num_samples} samples ({sum(counts)} with the accepted proposals)")
    return counts


def apply_verified(seq: Sequence, chunk: ScheduledChunk, token_ids: tuple[int, ...], kv_cache: KVCacheManager,
                   stats: SpecDecodeStats) -> list[TokenOutput]:
    """Appends a verified chunk's tokens up to a stop and counts the proposal; the last output's
    finish reason says whether the sequence stopped (the caller then finishes it, or trims the
    blocks reserved for rejected proposals)."""
    num_proposed, num_accepted = chunk.num_spec_tokens + chunk.num_draft_tokens, len(token_ids) - 1
    outputs: list[TokenOutput] = []
    first_output = seq.num_output_tokens
    for token_id in token_ids:
        reason = seq.append_token(token_id)
        outputs.append(TokenOutput(seq, token_id, reason))
        if reason is not None:
            break  # nothing past a stop
    # Valid K/V: the fed token and the accepted proposals; the rest is overwritten later.
    num_computed = chunk.start_position + 1 + min(len(outputs), num_accepted)
    kv_cache.cache_full_blocks(seq, num_computed)  # only verified positions: no rejected token is cached
    seq.num_computed_tokens = num_computed
    # Counted: accepted proposals kept; those past a stop are thrown away (vLLM counts the same). A stop
    # string is found later, in the text (coordinator/engine/outputs.py), which takes back those past it.
    num_kept = min(len(outputs), num_accepted)
    stats.record(num_proposed, num_kept)
    seq.speculation.counted_from, seq.speculation.num_counted = first_output, num_kept
    seq.speculation.record(num_proposed, num_accepted, seq.num_output_tokens)
    return outputs
