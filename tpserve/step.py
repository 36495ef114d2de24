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
  0. the host tier's copies (``--kv-offloading-size``; coordinator/kv_host_tier.py): every
     ``kv_swap_out`` (device block -> host slot) first, then every ``kv_swap_in`` (host slot ->
     device block), each in order, all before anything else of the step (a block evicted and
     reused in this plan is read out before a copy-in or the forward writes it);
  1. drop every sequence in ``finished_seq_ids`` (its blocks are the coordinator's
     to reuse from the next step on);
  2. register every ``NewSequence`` (a preempted sequence comes back this way,
     with ``start_position`` 0 and its whole block table in ``new_block_ids``);
  2a. hybrid models (worker/state_metadata.py): give each new sequence the live state slot
     ``NewSequence.state_slot``; copy each ``restored_states`` checkpoint slot into its
     sequence's live slot (a prefix hit resumes from the state saved at that boundary);
     a chunk with ``start_position`` 0 starts from a zeroed slot;
  2b. cut the block table of every sequence in ``trimmed_block_tables`` to its first
     ``num_blocks`` blocks (speculative decoding: blocks reserved for rejected
     proposals went back to the pool); unknown sequences are ignored;
  3. for each ``ScheduledChunk`` in order: append ``new_block_ids`` to the
     sequence's block table, then write the K/V of ``token_ids`` at positions
     ``start_position ..`` and attend over positions ``0 .. start_position + len(token_ids) - 1``
     (state layers carry the live slot's state through the tokens, copying it into the
     ``state_checkpoints`` slots after the rows named there);
  4. for each chunk with ``sample=True``, in plan order, sample one token from the
     logits of its last position; a chunk whose last ``num_spec_tokens`` tokens are
     proposals (speculative decoding) is verified: the sampling rank samples at each
     of its last ``num_spec_tokens + 1`` positions and keeps the longest prefix of
     proposals equal to those samples, plus the first sample that differs (or the
     bonus sample after the last proposal): ``1 + num_accepted`` tokens. A chunk with
     ``num_draft_tokens`` gets its proposals from the workers' draft model first.

Async scheduling (``--async-scheduling``; vLLM's name) plans step t+1 before step t's
result is back: a decode chunk of a sequence that step t samples carries
``PLACEHOLDER_TOKEN_ID`` as its one token, and the workers feed the token they
sampled for it in the step before (the sampling rank keeps it and, with tensor
parallelism, sends it to the others before anything else of the step: worker/placeholders.py).

Multi-step scheduling (``--num-scheduler-steps``; vLLM's name) runs one plan several times:
a plan with ``num_steps`` k > 1 holds only one-token decodes that sample (no new sequence), and
their blocks for k tokens each. The workers run it as above, then k - 1 times more as if each
chunk fed the token it sampled the time before at the next position (the placeholders of async
scheduling, filled the same way): the coordinator's round trip, and its work, come once per k
tokens. The result carries k consecutive tokens per chunk, as a verified chunk does.

This module imports no torch: the coordinator uses it too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tpserve import sampling_fields

#: Re-exported: the table's constants (tpserve/sampling_fields.py).
SEED_MODULUS = sampling_fields.SEED_MODULUS
MAX_TOP_LOGPROBS = sampling_fields.MAX_TOP_LOGPROBS

#: A decode chunk's token under async scheduling: "the token this sequence was sampled in the step before".
PLACEHOLDER_TOKEN_ID = -1
#: A sampled token in :class:`StepResult`: the sequence's grammar allowed no token at all (a dead end, or
#: llguidance hit a parser limit: worker/grammar.py); the coordinator fails the request (INVALID_ARGUMENT).
GRAMMAR_DEAD_END_TOKEN_ID = -2

#: The worker's fields: the table's (``stage != "coordinator"``), then what the coordinator fills in.
#: ``(name, annotation, default)``; the first four are also positional (temperature, top_k, top_p, seed).
_DERIVED_FIELDS = (
    ("min_tokens_stop_ids", "tuple[int, ...]", ()),
    ("grammar", "str", ""),
    ("grammar_stop_ids", "tuple[int, ...]", ()),
)
_ANNOTATIONS = {float: "float", int: "int", bool: "bool", dict: "tuple[tuple[int, float], ...]"}
_STEP_DEFAULTS = {"seed": 0}  # the coordinator draws an unset seed; a bare step's is 0


def _step_fields() -> list[tuple[str, str, object]]:
    fields = []
    for spec in sampling_fields.FIELDS:
        if not spec.on_worker:
            continue
        default = _STEP_DEFAULTS.get(spec.name, spec.default)
        annotation = _ANNOTATIONS[spec.type] + (" | None" if default is None else "")
        fields.append((spec.name, annotation, default))
    return fields + list(_DERIVED_FIELDS)


_HISTORY_FIELDS = tuple(spec for spec in sampling_fields.FIELDS if spec.history)
_PROCESSOR_FIELDS = tuple(spec for spec in sampling_fields.FIELDS if spec.stage == "processor")


class _SamplingParamsMethods:
    """The behaviour of :class:`SamplingParams`; its fields come from the table."""

    __slots__ = ()

    def __post_init__(self) -> None:
        self._check()
        # Computed once: the sampling rank asks for every row of every step.
        object.__setattr__(self, "_flags", (any(self._active(spec) for spec in _HISTORY_FIELDS),
                                            any(self._active(spec) for spec in _PROCESSOR_FIELDS)))

    def _check(self) -> None:
        for spec in sampling_fields.FIELDS:
            if not spec.on_worker:
                continue
            value = getattr(self, spec.name)
            if spec.type is dict:
                if any(not math.isfinite(bias) for _, bias in value):
                    raise ValueError(f"{spec.name} values must be finite")
            elif value is not None and (spec.low is not None or spec.high is not None):
                sampling_fields.check(spec.name, value)
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs needs logprobs, got {self.top_logprobs} (logprobs={self.logprobs})")

    def _active(self, spec: sampling_fields.SamplingField) -> bool:
        value = getattr(self, spec.name)
        return value != spec.default and value != () and (not spec.needs or bool(getattr(self, spec.needs)))

    @property
    def uses_penalties(self) -> bool:
        """True when a control that reads the token history is on (the repetition, presence, frequency penalties)."""
        return self._flags[0]

    @property
    def uses_token_history(self) -> bool:
        """True when sampling depends on the sequence's earlier tokens (a penalty or a grammar)."""
        return self.uses_penalties or bool(self.grammar)

    @property
    def uses_logits_controls(self) -> bool:
        """True when a logits processor beyond temperature / top-k / top-p is on (or a grammar)."""
        return bool(self.grammar) or self._flags[1]

    @property
    def allows_speculation(self) -> bool:
        """Whether speculative decoding may propose tokens for this request.

        Not with a control that depends on the tokens before each position (penalties,
        grammar, min_tokens, logit_bias, min_p, typical_p: verified rows would need per-position
        state) or that reports per token (logprobs, prompt_logprobs): such a request
        decodes one token per step (docs/design/scheduling.md, "Speculative decoding").
        """
        return not (self.uses_logits_controls or self.logprobs or self.prompt_logprobs is not None)

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax of the logits."""
        return self.temperature == 0.0


def _docstring() -> str:
    lines = ["How a worker turns one row of logits into a token.", "",
             "Fields from the sampling table (tpserve/sampling_fields.py; ranges as there):", ""]
    for name, annotation, default in _step_fields():
        spec = sampling_fields.FIELDS_BY_NAME.get(name)
        meaning = spec.help if spec else {
            "min_tokens_stop_ids": "the tokens min_tokens holds back (eos unless ignored, stop token ids)",
            "grammar": "an llguidance grammar (JSON text) the output must follow, or \"\"",
            "grammar_stop_ids": "with a grammar, the tokens that end the sequence, allowed where it accepts"}[name]
        lines.append(f"    {name} ({annotation}, default {default!r}): {meaning}")
    lines += ["", "The noise for the token at position p depends only on (seed, p); logprobs come from the",
              "raw distribution. The order on the worker: worker/logits_processors.py.", "",
              "Raises:", "    ValueError: a value is outside its range."]
    return "\n".join(lines)


def _make_sampling_params() -> type:
    cls = dataclasses.make_dataclass(
        "SamplingParams", [(name, annotation, dataclasses.field(default=default))
                           for name, annotation, default in _step_fields()]
        + [("_flags", "tuple[bool, bool]", dataclasses.field(init=False, repr=False, compare=False))],
        bases=(_SamplingParamsMethods,), frozen=True, slots=True)
    cls.__module__ = __name__  # pickling and repr name it tpserve.step.SamplingParams
    cls.__doc__ = _docstring()
    return cls


if TYPE_CHECKING:  # its fields are the table's: a type checker sees a class that takes and has any of them
    class SamplingParams(_SamplingParamsMethods):
        def __init__(self, *args: Any, **fields: Any) -> None: ...
        def __getattr__(self, name: str) -> Any: ...
else:
    SamplingParams = _make_sampling_params()


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
        lora_slot: ``--enable-lora``: the resident slot of the sequence's adapter
            (``1 .. --max-loras``, worker/lora_adapters.py); 0, the default: the base model.
        state_slot: hybrid models: the sequence's live state slot (``0 .. --max-num-seqs - 1``,
            coordinator/state_slots.py), held until it finishes or is preempted; 0 otherwise.
    """

    seq_id: int
    sampling: SamplingParams
    num_prompt_tokens: int = 0
    history_token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    lora_slot: int = 0
    state_slot: int = 0


# Not frozen: built per sequence per step (0.14 µs against 0.73 frozen; docs/design/request-path.md); never mutated.
@dataclass(slots=True)
class ScheduledChunk:
    """The tokens one sequence contributes to this step's flat batch.

    Attributes:
        seq_id: the sequence.
        token_ids: tokens fed this step: a prompt chunk (prefill) or the last
            sampled token (decode). Never empty. Under async scheduling a decode's
            one token may be ``PLACEHOLDER_TOKEN_ID``: the token the step before
            sampled for the sequence, not yet known to the coordinator.
        start_position: absolute position of ``token_ids[0]``; equals the number
            of the sequence's tokens already in the KV cache.
        new_block_ids: KV block ids appended to the sequence's block table before
            the step. Block ``i`` of the table holds positions
            ``[i * block_size, (i + 1) * block_size)``.
        sample: whether to sample the token that follows ``token_ids[-1]``
            (False for a prefill chunk that is not the prompt's last).
        num_spec_tokens: how many of the last ``token_ids`` are proposed tokens to
            verify (docs/design/scheduling.md, "Speculative decoding"); 0 for an ordinary chunk.
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
    #: Hybrid models' prefix hits: ``(seq_id, checkpoint slot)``: copy the checkpoint into the
    #: sequence's live state slot before the step (its first chunk starts at the checkpoint's boundary).
    restored_states: tuple[tuple[int, int], ...] = ()
    #: Hybrid models' prefix caching: ``(seq_id, num_rows, checkpoint slot)``: after the first
    #: ``num_rows`` tokens of the sequence's chunk in this step, save its state into the slot (a
    #: prompt block boundary). Per sequence in increasing ``num_rows``.
    state_checkpoints: tuple[tuple[int, int, int], ...] = ()
    #: Host tier: ``(device block, host slot)`` copies out, then ``(host slot, device block)`` copies in.
    kv_swap_out: tuple[tuple[int, int], ...] = ()
    kv_swap_in: tuple[tuple[int, int], ...] = ()
    #: Multi-step scheduling: the workers run the plan's decodes this many times (module docstring).
    num_steps: int = 1

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
            tokens (the accepted proposals, then one sampled token), a chunk of a
            multi-step plan ``plan.num_steps`` (one per step). Empty on ranks
            other than 0.
        num_accepted_tokens: when the plan has proposals, one count per chunk with
            ``sample=True``, in plan order (0 for a chunk without proposals); empty
            otherwise (every sample then gave one token).
        logprobs: for the samples whose sequence asked (``SamplingParams.logprobs``)
            only, in sample order; empty otherwise. A multi-step plan's sample
            ``i * num_steps + j`` is chunk i's token of step j.
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
