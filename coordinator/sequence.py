"""A sequence: one request's tokens, progress through the KV cache, and stop rules.

Token-level state only; text (detokenization, stop strings) lives in the request
state of :mod:`coordinator.engine`. No torch.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from coordinator.spec_decode import AdaptiveSpeculation
from tpserve.step import GRAMMAR_DEAD_END_TOKEN_ID, PLACEHOLDER_TOKEN_ID, SamplingParams, ScheduledChunk


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # cancelled, deadline, shutdown or worker failure


@dataclass(frozen=True, slots=True)
class StopParams:
    """When a sequence stops, at the token level.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        eos_token_ids: tokens that stop unless ``ignore_eos``.
        stop_token_ids: tokens that always stop.
        ignore_eos: keep generating after an eos token.
    """

    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's token sequence as the scheduler sees it.

    Attributes:
        seq_id: unique id, also the workers' key for the sequence.
        prompt_token_ids: the prompt (BOS included when the tokenizer adds it).
        sampling: sent to the workers when the sequence is (re)admitted.
        stop: token-level stop rules.
        max_model_len: longest the sequence may grow, in tokens.
        output_token_ids: sampled tokens, the stopping token included.
        num_computed_tokens: tokens whose K/V are in the cache.
        block_ids: the block table; block i holds positions [i*block_size, (i+1)*block_size).
        on_workers: whether the workers hold state for this sequence.
        block_hashes: chained hashes of the sequence's full blocks so far
            (:func:`coordinator.kv_cache_manager.extend_block_hashes`); they depend only on the tokens, so they
            stay valid across preemptions.
        num_cached_prompt_tokens: prompt tokens (a continuation's given tokens included) found in the
            prefix cache at the sequence's first admission (reported as usage); None before it.
        prompt_logprobs: with ``sampling.prompt_logprobs``: position -> the worker's
            logprobs of that prompt token (filled once, whatever recomputes it).
        speculation: whether speculative decoding is paused for it (poor acceptance).
        cache_namespace: the prefix-cache namespace block 0's hash chains from
            (:func:`coordinator.cache_isolation.prefix_cache_namespace`: the caller's tenant
            and ``cache_salt``); ``b""`` for the anonymous, unsalted one.
        lora_slot: its LoRA adapter's resident slot on the workers (``--lora-modules`` order, from 1);
            0: the base model.
        state_slot: hybrid models: its live state slot while admitted (coordinator/state_slots.py); -1 otherwise.
        priority: the queue's order: lower values are admitted first, and preempted
            last (vLLM's convention); equal priorities keep arrival order. Default 0.
        num_pending_tokens: async scheduling: tokens that steps in flight sample for it,
            not applied yet (their positions are already counted in ``num_computed_tokens``
            once fed); 0 otherwise.
        admitted_step: the step id of the plan that last admitted it (new or after a
            preemption); a result of an earlier plan belongs to a former admission.
        arrival_s: when it reached the scheduler (its clock's seconds), for priority aging
            (:mod:`coordinator.priority`); None before.
        admitted_at_output: its output length when it was last admitted (new, or resumed after
            a preemption): it is not preempted before its output grows (:mod:`coordinator.priority`);
            None before its first admission.
        admitted_s: when it was admitted, each time (``time.monotonic()`` seconds): its first
            admission, then one per resume after a preemption (coordinator/request_timeline.py).
        preempted_s: when it was preempted for want of KV blocks, each time (same clock).
        prefill_chunks_s: each prefill chunk's end and the positions it computed:
            ``(time.monotonic(), start, end)``, one per prefill step (not per token; decode
            steps add nothing): the request's trace has a span per chunk.
        num_continued_tokens: the output tokens it was created with: a continued stream's earlier
            output (the request's ``generated_token_ids``), which this server computes as prompt and
            did not generate: usage and the metrics count them as prompt tokens. Set at creation.
    """

    seq_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: StopParams
    max_model_len: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    on_workers: bool = False
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_prompt_tokens: int | None = None
    prompt_logprobs: dict[int, tuple[float, tuple[int, ...], tuple[float, ...]]] = field(default_factory=dict)
    speculation: AdaptiveSpeculation = field(default_factory=AdaptiveSpeculation)
    cache_namespace: bytes = b""
    lora_slot: int = 0
    state_slot: int = -1
    priority: int = 0
    num_pending_tokens: int = 0
    admitted_step: int = -1
    arrival_s: float | None = None
    admitted_at_output: int | None = None
    admitted_s: list[float] = field(default_factory=list)
    preempted_s: list[float] = field(default_factory=list)
    prefill_chunks_s: list[tuple[float, int, int]] = field(default_factory=list)
    num_continued_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.num_continued_tokens = len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_usage_prompt_tokens(self) -> int:
        """Usage's prompt tokens: the prompt and a continuation's given tokens (the server computed, not generated, them)."""
        return len(self.prompt_token_ids) + self.num_continued_tokens

    @property
    def num_usage_completion_tokens(self) -> int:
        """Usage's completion tokens: those this server generated (the stopping token included)."""
        return len(self.output_token_ids) - self.num_continued_tokens

    def token_ids(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens at positions [start, end) of prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return tuple(self.prompt_token_ids[start:end])
        if start >= num_prompt:
            return tuple(self.output_token_ids[start - num_prompt : end - num_prompt])
        return tuple(self.prompt_token_ids[start:]) + tuple(self.output_token_ids[: end - num_prompt])

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> FinishReason | None:
        """Appends a sampled token and returns why the sequence stops, if it does: ABORT, appending nothing, for
        rank 0's ``GRAMMAR_DEAD_END_TOKEN_ID`` (its grammar allowed no token; the engine fails the request)."""
        if token_id == GRAMMAR_DEAD_END_TOKEN_ID:
            return FinishReason.ABORT
        self.output_token_ids.append(token_id)
        if token_id in self.stop.stop_token_ids or (not self.stop.ignore_eos and token_id in self.stop.eos_token_ids):
            return FinishReason.STOP
        if len(self.output_token_ids) >= self.stop.max_tokens or self.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def note_computed(self, start: int, num_computed: int) -> None:
        """A step computed positions ``[start, num_computed)``. Async scheduling may have counted them
        when it planned (and later plans gone further), so the count only grows. A prefill chunk's end
        is noted (more than one position, or a prompt position): decode steps pass one position past
        the prompt and note nothing."""
        if num_computed > self.num_computed_tokens:
            self.num_computed_tokens = num_computed
        if num_computed - start > 1 or num_computed <= self.num_prompt_tokens:
            self.prefill_chunks_s.append((time.monotonic(), start, num_computed))

    def note_preempted(self) -> None:
        """Counts a preemption for want of KV blocks (not per step: rare) and its time."""
        self.num_preemptions += 1
        self.preempted_s.append(time.monotonic())

    def is_stop_token(self, token_id: int) -> bool:
        """Whether ``token_id`` ends the sequence as a token (eos unless ignored, a stop id); it is not returned."""
        return token_id in self.stop.stop_token_ids or (not self.stop.ignore_eos and token_id in self.stop.eos_token_ids)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Forgets the output after its first ``num_output_tokens`` tokens (a stop string matched
        inside a multi-token step: usage counts only what was returned). Only on a finished sequence."""
        assert self.is_finished, "only a finished sequence's output is cut"
        del self.output_token_ids[num_output_tokens:]

    def stopped_on_token(self) -> bool:
        """Whether the last token is a stop token (eos or stop id), which is not returned."""
        if self.finish_reason is not FinishReason.STOP or not self.output_token_ids:
            return False
        last = self.output_token_ids[-1]
        return last in self.stop.stop_token_ids or (not self.stop.ignore_eos and last in self.stop.eos_token_ids)


def scheduled_chunk(seq: Sequence, num_new: int, new_block_ids: list[int], proposal: tuple[int, ...] = (),
                    num_draft: int = 0) -> ScheduledChunk:
    """``seq``'s next ``num_new`` tokens from its first uncomputed position as a plan's chunk (the scheduler's),
    with ``new_block_ids`` appended to its table, ``proposal`` speculative tokens after them and ``num_draft``
    of them from a draft model."""
    start, num_known = seq.num_computed_tokens, seq.num_tokens
    # A position past the known tokens holds a pending one (async scheduling): the workers have it.
    tokens = seq.token_ids(start, start + num_new) if start + num_new <= num_known else \
        seq.token_ids(start, num_known) + (PLACEHOLDER_TOKEN_ID,) * (start + num_new - max(start, num_known))
    return ScheduledChunk(
        seq_id=seq.seq_id,
        token_ids=tokens + proposal,
        start_position=start,
        new_block_ids=tuple(new_block_ids),
        sample=start + num_new == num_known + seq.num_pending_tokens,
        num_spec_tokens=len(proposal),
        num_draft_tokens=num_draft,
    )
