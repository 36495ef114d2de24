"""The step protocol between the coordinator and the worker ranks, as plain data.

Data flow (see ARCHITECTURE.md, "The request path"):

    coordinator.Scheduler.schedule() -> StepPlan --(gRPC, proto/tpserve/v1/worker.proto)-->
    every worker rank: ModelRunner.execute(StepPlan) -> StepResult (rank 0 carries tokens)
    --> coordinator.Scheduler.update(plan, result)

A plan is a *delta* (vLLM v1 style): a sequence's sampling parameters travel once,
when it is new; afterwards each step names only the tokens to feed and the KV
blocks added to its block table. Workers keep a per-sequence block table and
drop it when the sequence is named in ``finished_seq_ids``.

Order of application on a worker, fixed so every rank agrees:
  1. drop every sequence in ``finished_seq_ids`` (its blocks are the coordinator's
     to reuse from the next step on);
  2. register every ``NewSequence`` (a preempted sequence comes back this way,
     with ``start_position`` 0 and its whole block table in ``new_block_ids``);
  2b. cut the block table of every sequence in ``trimmed_block_tables`` to its first
     ``num_blocks`` blocks (speculative decoding: blocks reserved for rejected
     proposals went back to the pool); unknown sequences are ignored;
  3. for each ``ScheduledChunk`` in order: append ``new_block_ids`` to the
     sequence's block table, then write the K/V of ``token_ids`` at positions
     ``start_position ..`` and attend over positions ``0 .. start_position + len(token_ids) - 1``;
  4. for each chunk with ``sample=True``, in plan order, sample one token from the
     logits of its last position; a chunk whose last ``num_spec_tokens`` tokens are
     proposals (speculative decoding) is verified: the sampling rank samples at each
     of its last ``num_spec_tokens + 1`` positions and keeps the longest prefix of
     proposals equal to those samples, plus the first sample that differs (or the
     bonus sample after the last proposal): ``1 + num_accepted`` tokens. A chunk with
     ``num_draft_tokens`` gets its proposals from the workers' draft model first.

This module imports no torch: the coordinator uses it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: Unsigned 64-bit range of a sampling seed.
SEED_MODULUS = 1 << 64
#: Most ``top_logprobs`` a request may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a worker turns one row of logits into a token.

    Attributes:
        temperature: softmax temperature, >= 0. ``0`` means greedy (argmax).
        top_k: keep the ``top_k`` most likely tokens; ``0`` disables the filter.
        top_p: nucleus sampling (Holtzman et al. 2019, arXiv:1904.09751): keep the
            smallest set of most likely tokens whose probability sum reaches
            ``top_p``; in (0, 1], ``1.0`` disables the filter.
        seed: unsigned 64-bit seed. The noise used for the token at absolute
            position ``p`` depends only on ``(seed, p)``, so a request samples the
            same tokens whatever else shares its batch, and after a preemption.
        min_p: drop tokens whose probability (after temperature) is below
            ``min_p`` times the most likely token's, in [0, 1]; 0 disables it.
        repetition_penalty: CTRL's penalty (Keskar et al. 2019, arXiv:1909.05858)
            on every token of the prompt and the output: a positive logit is
            divided by it, a negative one multiplied; > 0, 1 disables it.
        presence_penalty: subtracted once from the logit of every token already
            in the output, in [-2, 2].
        frequency_penalty: subtracted from a token's logit once per time it is in
            the output, in [-2, 2].
        logit_bias: ``(token id, bias)`` pairs added to the logits, sorted by id.
        min_tokens: until this many tokens are generated, ``min_tokens_stop_ids``
            cannot be sampled.
        min_tokens_stop_ids: the tokens that would end the sequence (eos unless
            ignored, and the stop token ids), filled in by the coordinator.
        logprobs: return the sampled token's log-probability, from the model's raw
            distribution (``log_softmax`` of the logits before any control).
        top_logprobs: with ``logprobs``, also the ``top_logprobs`` most likely
            tokens of that distribution, in [0, 20].
        grammar: an llguidance grammar (JSON text) the output must follow, or "";
            built and validated by the coordinator from the request's response_format.
        grammar_stop_ids: with a grammar, the tokens that end the sequence (the
            model's eos ids, filled in by the coordinator): allowed exactly where the
            grammar accepts, whatever llguidance's own idea of eos.
        prompt_logprobs: None, or return each prompt token's log-probability (from
            the second on) with the ``prompt_logprobs`` (0 to 20) most likely tokens
            at its position; raw distribution, as ``logprobs``.

    Order on the worker (vLLM's): logit_bias and min_tokens, then the penalties
    (greedy rows take the argmax here), then temperature, min_p, top-k, top-p.

    Raises:
        ValueError: a value is outside the range above.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_tokens_stop_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: str = ""
    grammar_stop_ids: tuple[int, ...] = ()
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < SEED_MODULUS:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(not math.isfinite(bias) for _, bias in self.logit_bias):
            raise ValueError("logit_bias values must be finite")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS or (self.top_logprobs and not self.logprobs):
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}] and needs logprobs, "
                             f"got {self.top_logprobs} (logprobs={self.logprobs})")

    @property
    def uses_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty is on."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def uses_token_history(self) -> bool:
        """True when sampling depends on the sequence's earlier tokens (a penalty or a grammar)."""
        return self.uses_penalties or bool(self.grammar)

    @property
    def uses_logits_controls(self) -> bool:
        """True when anything beyond temperature / top-k / top-p changes the logits."""
        return (self.uses_token_history or self.min_p > 0.0 or bool(self.logit_bias)
                or (self.min_tokens > 0 and bool(self.min_tokens_stop_ids)))

    @property
    def allows_speculation(self) -> bool:
        """Whether speculative decoding may propose tokens for this request.

        Not with a control that depends on the tokens before each position (penalties,
        grammar, min_tokens, logit_bias, min_p: verified rows would need per-position
        state) or that reports per token (logprobs, prompt_logprobs): such a request
        decodes one token per step (docs/design.md, "Speculative decoding").
        """
        return not (self.uses_logits_controls or self.logprobs or self.prompt_logprobs is not None)

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax of the logits."""
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class NewSequence:
    """A sequence the workers have not seen (or dropped after a preemption).

    Attributes:
        seq_id: the sequence.
        sampling: its sampling parameters.
        num_prompt_tokens: its prompt's length: tokens at later positions are output
            (``min_tokens`` and the output penalties count them).
        history_token_ids: only when ``sampling.uses_token_history``: the tokens at
            positions ``0 .. start_position - 1`` of its first chunk, which the workers
            are not sent otherwise (a cached prefix); empty otherwise.
        prompt_token_ids: only with ``sampling.prompt_logprobs``: the whole prompt
            (a chunk's last row scores the next chunk's first token).
    """

    seq_id: int
    sampling: SamplingParams
    num_prompt_tokens: int = 0
    history_token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """The tokens one sequence contributes to this step's flat batch.

    Attributes:
        seq_id: the sequence.
        token_ids: tokens fed this step: a prompt chunk (prefill) or the last
            sampled token (decode). Never empty.
        start_position: absolute position of ``token_ids[0]``; equals the number
            of the sequence's tokens already in the KV cache.
        new_block_ids: KV block ids appended to the sequence's block table before
            the step. Block ``i`` of the table holds positions
            ``[i * block_size, (i + 1) * block_size)``.
        sample: whether to sample the token that follows ``token_ids[-1]``
            (False for a prefill chunk that is not the prompt's last).
        num_spec_tokens: how many of the last ``token_ids`` are proposed tokens to
            verify (speculative decoding; docs/design.md); 0 for an ordinary chunk.
            Only with ``sample=True`` and fewer than ``len(token_ids)``.
        num_draft_tokens: ``--speculative-method draft``: the workers' draft model
            proposes this many tokens after ``token_ids``, verified in the same step
            like ``num_spec_tokens`` (the blocks hold them too). Only with
            ``sample=True`` and ``num_spec_tokens == 0``.
    """

    seq_id: int
    token_ids: tuple[int, ...]
    start_position: int
    new_block_ids: tuple[int, ...] = ()
    sample: bool = True
    num_spec_tokens: int = 0
    num_draft_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Number of tokens this chunk adds to the step's batch."""
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step for every worker rank; see the module docstring for its order."""

    step_id: int
    new_seqs: tuple[NewSequence, ...] = ()
    scheduled: tuple[ScheduledChunk, ...] = ()
    finished_seq_ids: tuple[int, ...] = ()
    #: ``(seq_id, num_blocks)``: keep only the first ``num_blocks`` of the sequence's table.
    trimmed_block_tables: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens in the step's flat batch (prefill and decode together)."""
        return sum(chunk.num_tokens for chunk in self.scheduled)

    @property
    def num_samples(self) -> int:
        """Number of tokens the step samples (chunks with ``sample=True``)."""
        return sum(1 for chunk in self.scheduled if chunk.sample)

    @property
    def num_spec_tokens(self) -> int:
        """Proposed tokens the step verifies (0 without speculative decoding)."""
        return sum(chunk.num_spec_tokens + chunk.num_draft_tokens for chunk in self.scheduled)


@dataclass(frozen=True, slots=True)
class SampleLogprobs:
    """Log-probabilities of one sampled token, for a sequence that asked for them.

    Attributes:
        sample_index: which of the step's samples (index into ``sampled_token_ids``).
        logprob: the sampled token's log-probability under the raw distribution.
        top_token_ids, top_logprobs: the ``top_logprobs`` most likely tokens and their
            log-probabilities, most likely first.
    """

    sample_index: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Log-probabilities of one sequence's prompt tokens ``first_position ..`` computed this step.

    Attributes:
        seq_id: the sequence.
        first_position: position of the first scored prompt token (>= 1).
        logprobs: each scored token's log-probability given the tokens before it.
        top_token_ids, top_logprobs: per scored position, the ``prompt_logprobs`` most
            likely tokens there and their log-probabilities, most likely first.
    """

    seq_id: int
    first_position: int
    logprobs: tuple[float, ...]
    top_token_ids: tuple[tuple[int, ...], ...] = ()
    top_logprobs: tuple[tuple[float, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class StepResult:
    """What rank 0 returns for a step.

    Attributes:
        step_id: the plan's ``step_id``.
        sampled_token_ids: one token per chunk with ``sample=True``, in plan order;
            a chunk with proposals gives ``1 + num_accepted_tokens[i]`` consecutive
            tokens (the accepted proposals, then one sampled token). Empty on ranks
            other than 0.
        num_accepted_tokens: when the plan has proposals, one count per chunk with
            ``sample=True``, in plan order (0 for a chunk without proposals); empty
            otherwise (every sample then gave one token).
        logprobs: for the samples whose sequence asked (``SamplingParams.logprobs``)
            only, in sample order; empty otherwise.
        prompt_logprobs: for the chunks whose sequence asked for prompt logprobs.
        expert_token_counts: mixture-of-experts models only: the tokens each expert
            received this step, as flat ``(layer, expert, num_tokens)`` triples of the
            nonzero counts (``layer``: the decoder layer's index); empty otherwise.
        model_execute_time_s: seconds the rank spent executing the step (set by the
            rank's step stream, worker/server.py; 0 when not measured).
        wait_time_s: seconds the rank waited for this plan after sending its previous
            result (0 for its first step).
    """

    step_id: int
    sampled_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: tuple[SampleLogprobs, ...] = ()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    num_accepted_tokens: tuple[int, ...] = ()
    expert_token_counts: tuple[int, ...] = ()
    model_execute_time_s: float = 0.0
    wait_time_s: float = 0.0
