"""Logits processors of the sampling rank: one small class per control, applied in an order declared once.

:data:`ORDER` is the order, vLLM v1's (vllm/v1/sample/sampler.py): the structured-output
grammar's mask, then the processors that can change the argmax (logit_bias, min_tokens),
then the penalties; greedy rows take their argmax there; then the temperature
(worker/sampler.py), then the processors that keep the argmax (``after_temperature``:
min_p, typical_p), then top-k / top-p (worker/sampler.py). On a row of float32 logits ``l``:

* :class:`GrammarMask`: tokens the grammar (worker/grammar.py) disallows get ``-inf``;
* :class:`LogitBias`: ``l[v] += bias[v]``;
* :class:`MinTokens`: while fewer than ``min_tokens`` tokens are generated, the stop
  tokens (eos unless ignored, stop token ids) get ``-inf``;
* :class:`Penalties`, with ``prompt`` and ``output`` the sequence's tokens so far:
  ``repetition_penalty`` r on every token of prompt or output (CTRL, Keskar et al. 2019,
  arXiv:1909.05858: ``l / r`` where ``l > 0``, else ``l * r``), then
  ``l -= frequency_penalty * count_output(v) + presence_penalty * (count_output(v) > 0)``
  (OpenAI's definition);
* :class:`MinP`: after the temperature, tokens whose probability is below
  ``min_p * max probability`` get ``-inf`` (Nguyen et al. 2024, arXiv:2407.01082);
* :class:`TypicalP`: after the temperature, the tokens whose surprisal is closest to the
  distribution's entropy are kept until their probability reaches ``typical_p``, the rest
  get ``-inf`` (Meister et al. 2022, arXiv:2202.00666).

Each processor reads its own fields of :class:`~tpserve.step.SamplingParams` (declared in
tpserve/sampling_fields.py), packs its own per-row tensors with :meth:`LogitsProcessor.build`
(None when no row of the batch uses it: it then costs nothing) and works on the rows that use
it only. A batch where no row uses any processor skips all of this after one pass over the
rows' host-side flags. Each row's tensors come from its own tokens only, so a request's tokens
do not depend on what else shares its batch. The token history (the penalties') is kept on the
sampling rank for the sequences that need it: the coordinator sends what the rank never sees
in a chunk (``NewSequence.history_token_ids``, a cached prefix) and every chunk's tokens are
appended (:func:`extend_history`).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
import structlog
import torch

from tpserve.step import SamplingParams, ScheduledChunk
from worker.grammar import GrammarCache, GrammarState

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class SampledRow:
    """What a processor may read about one sampled row.

    Attributes:
        params: the row's sampling parameters.
        num_prompt_tokens: its sequence's prompt length (later positions are output).
        position: position of the token the row samples (= tokens before it).
        history: the sequence's tokens at positions ``0 .. position - 1`` when it keeps
            them (``params.uses_token_history``), else None.
        grammar_allowed: ``(V,) bool`` the tokens its grammar allows now, or None.
    """

    params: SamplingParams
    num_prompt_tokens: int
    position: int
    history: Sequence[int] | None = None
    grammar_allowed: np.ndarray | None = None


class LogitsProcessor(ABC):
    """One control: packs its rows' tensors once per step and transforms ``(N, V)`` float32 logits."""

    #: The SamplingParams fields it reads (tpserve/sampling_fields.py: each ``processor`` field has one reader).
    fields: ClassVar[tuple[str, ...]] = ()
    #: Applied to ``logits / temperature`` of the sampled rows, after the greedy argmax.
    after_temperature: ClassVar[bool] = False

    @staticmethod
    @abstractmethod
    def wants(row: SampledRow) -> bool:
        """Whether the processor changes this row."""

    @classmethod
    def build(cls, rows: Sequence[SampledRow], device: torch.device | str) -> LogitsProcessor | None:
        """The processor for a batch's rows, or None when none of them wants it."""
        used = [i for i, row in enumerate(rows) if cls.wants(row)]
        if not used:
            return None
        return cls._build(used, [rows[i] for i in used], device, len(used) == len(rows))

    @classmethod
    @abstractmethod
    def _build(cls, indices: list[int], rows: list[SampledRow], device: torch.device | str,
               all_rows: bool) -> LogitsProcessor:
        """Packs the tensors of the rows that want it (``indices``: their rows in the batch; ``all_rows``:
        every row of the batch wants it)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Transforms ``(N, V)`` float32 logits, in place where it can; returns the result."""


class _RowSubset(LogitsProcessor):
    """A processor that computes on its rows only: gathers them, transforms, writes them back."""

    def __init__(self, rows: torch.Tensor, all_rows: bool) -> None:
        self.rows, self.all_rows = rows, all_rows  # (R,) int64 rows of the batch

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.all_rows:
            return self.apply_rows(logits)
        logits[self.rows] = self.apply_rows(logits[self.rows])  # (R, V)
        return logits

    @abstractmethod
    def apply_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Transforms the ``(R, V)`` logits of the processor's rows."""


class GrammarMask(LogitsProcessor):
    """Structured output: ``-inf`` for the tokens a row's grammar disallows."""

    fields = ("grammar",)

    def __init__(self, rows: torch.Tensor, allowed: torch.Tensor) -> None:
        self.rows, self.allowed = rows, allowed  # (G,) int64, (G, V') bool

    @staticmethod
    def wants(row: SampledRow) -> bool:
        return row.grammar_allowed is not None

    @classmethod
    def _build(cls, indices, rows, device, all_rows):
        allowed = torch.from_numpy(np.stack([row.grammar_allowed for row in rows])).to(device)
        return cls(_ints(indices, device), allowed)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        allowed = self.allowed[:, :logits.shape[-1]]  # (G, V) the mask may be padded past the vocabulary
        logits[self.rows] = logits[self.rows].masked_fill(~allowed, float("-inf"))
        return logits


class LogitBias(LogitsProcessor):
    """``logit_bias``: ``logits[row, token] += bias`` for each (row, token, bias) entry."""

    fields = ("logit_bias",)

    def __init__(self, rows: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> None:
        self.rows, self.ids, self.values = rows, ids, values  # (B,) int64, (B,) int64, (B,) float32

    @staticmethod
    def wants(row: SampledRow) -> bool:
        return bool(row.params.logit_bias)

    @classmethod
    def _build(cls, indices, rows, device, all_rows):
        entries = [(i, token, bias) for i, row in zip(indices, rows) for token, bias in row.params.logit_bias]
        r, ids, values = zip(*entries)
        return cls(_ints(r, device), _ints(ids, device), torch.tensor(values, dtype=torch.float32, device=device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_put_((self.rows, self.ids), self.values, accumulate=True)


class MinTokens(LogitsProcessor):
    """``min_tokens``: ``-inf`` for the stop tokens of rows that have generated fewer."""

    fields = ("min_tokens",)

    def __init__(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        self.rows, self.ids = rows, ids  # (K,) int64 each

    @staticmethod
    def wants(row: SampledRow) -> bool:
        return row.position - row.num_prompt_tokens < row.params.min_tokens and bool(row.params.min_tokens_stop_ids)

    @classmethod
    def _build(cls, indices, rows, device, all_rows):
        bans = [(i, token) for i, row in zip(indices, rows) for token in row.params.min_tokens_stop_ids]
        r, ids = zip(*bans)
        return cls(_ints(r, device), _ints(ids, device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_put_((self.rows, self.ids), torch.tensor(float("-inf"), device=logits.device))


class Penalties(_RowSubset):
    """``repetition_penalty`` (prompt and output tokens), then ``frequency_penalty`` and ``presence_penalty``
    (output tokens), on the rows that set one.

    Attributes:
        penalties: ``(R, 3) float32`` each row's (repetition, presence, frequency).
        seen_rows, seen_ids: ``(S,) int64`` each row's prompt and output tokens (repeats allowed).
        out_rows, out_ids: ``(O,) int64`` each row's output tokens, one entry per occurrence.
    """

    fields = ("repetition_penalty", "presence_penalty", "frequency_penalty")

    def __init__(self, rows: torch.Tensor, all_rows: bool, penalties: torch.Tensor, seen_rows: torch.Tensor,
                 seen_ids: torch.Tensor, out_rows: torch.Tensor, out_ids: torch.Tensor) -> None:
        super().__init__(rows, all_rows)
        self.penalties = penalties
        self.seen_rows, self.seen_ids, self.out_rows, self.out_ids = seen_rows, seen_ids, out_rows, out_ids

    @staticmethod
    def wants(row: SampledRow) -> bool:
        return row.params.uses_penalties

    @classmethod
    def _build(cls, indices, rows, device, all_rows):
        for i, row in zip(indices, rows):
            if row.history is None or len(row.history) < row.position:
                known = 0 if row.history is None else len(row.history)
                raise ValueError(f"row {i} uses a penalty but {known} of its {row.position} tokens are known")
        # Flat (row, token) lists, scattered into (R, V) on the device: no per-token Python work.
        seen_ids = [t for row in rows for t in row.history[:row.position]]
        seen_rows = [r for r, row in enumerate(rows) for _ in range(row.position)]
        out_ids = [t for row in rows for t in row.history[row.num_prompt_tokens:row.position]]
        out_rows = [r for r, row in enumerate(rows) for _ in range(max(0, row.position - row.num_prompt_tokens))]
        penalties = torch.tensor([(row.params.repetition_penalty, row.params.presence_penalty,
                                   row.params.frequency_penalty) for row in rows], dtype=torch.float32)  # (R, 3)
        return cls(_ints(indices, device), all_rows, penalties.to(device),
                   _ints(seen_rows, device), _ints(seen_ids, device), _ints(out_rows, device), _ints(out_ids, device))

    def apply_rows(self, logits: torch.Tensor) -> torch.Tensor:
        seen = torch.zeros_like(logits, dtype=torch.bool)  # (R, V) in the prompt or the output
        seen[self.seen_rows, self.seen_ids] = True
        counts = torch.zeros_like(logits)  # (R, V) occurrences in the output
        counts.index_put_((self.out_rows, self.out_ids), torch.ones_like(self.out_ids, dtype=logits.dtype),
                          accumulate=True)
        repetition = torch.where(seen, self.penalties[:, 0:1], 1.0)  # (R, V)
        logits = torch.where(logits > 0, logits / repetition, logits * repetition)  # (R, V)
        return logits - self.penalties[:, 2:3] * counts - self.penalties[:, 1:2] * (counts > 0)  # (R, V)


class MinP(_RowSubset):
    """``min_p``, after the temperature: ``-inf`` for tokens less likely than ``min_p`` times the row's top token."""

    fields = ("min_p",)
    after_temperature = True

    def __init__(self, rows: torch.Tensor, all_rows: bool, min_p: torch.Tensor) -> None:
        super().__init__(rows, all_rows)
        self.min_p = min_p  # (R,) float32 in (0, 1]

    @staticmethod
    def wants(row: SampledRow) -> bool:
        return row.params.min_p > 0.0 and row.params.temperature > 0.0

    @classmethod
    def _build(cls, indices, rows, device, all_rows):
        min_p = torch.tensor([row.params.min_p for row in rows], dtype=torch.float32, device=device)
        return cls(_ints(indices, device), all_rows, min_p)

    def apply_rows(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_min_p(logits, self.min_p)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``-inf`` for tokens whose probability is below ``min_p`` times the row's largest.

    Args:
        logits: ``(N, V)`` float32, already divided by the temperature.
        min_p: ``(N,) float32`` in [0, 1]; 0 keeps every token.

    Returns:
        ``(N, V)`` float32, the kept logits unchanged.
    """
    probs = logits.softmax(dim=-1)  # (N, V)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # (N, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))  # (N, V)


class TypicalP(_RowSubset):
    """``typical_p``, locally typical sampling (Meister et al. 2022, arXiv:2202.00666), after the temperature.

    With ``H = -sum p log p`` the row's entropy, tokens are ranked by how far their surprisal is
    from it, ``|-log p(v) - H|`` (closest first, stable); the row keeps the shortest such prefix
    whose probability reaches ``typical_p`` (and every token as close as its last), the rest get
    ``-inf`` (transformers' TypicalLogitsWarper).
    """

    fields = ("typical_p",)
    after_temperature = True

    def __init__(self, rows: torch.Tensor, all_rows: bool, mass: torch.Tensor) -> None:
        super().__init__(rows, all_rows)
        self.mass = mass  # (R, 1) float32 in (0, 1)

    @staticmethod
    def wants(row: SampledRow) -> bool:
        return row.params.typical_p < 1.0 and row.params.temperature > 0.0

    @classmethod
    def _build(cls, indices, rows, device, all_rows):
        mass = torch.tensor([[row.params.typical_p] for row in rows], dtype=torch.float32, device=device)
        return cls(_ints(indices, device), all_rows, mass)

    def apply_rows(self, logits: torch.Tensor) -> torch.Tensor:
        log_p = logits.log_softmax(dim=-1)  # (R, V)
        p = log_p.exp()  # (R, V)
        entropy = -(p * log_p).nansum(dim=-1, keepdim=True)  # (R, 1) a -inf logit adds 0 * -inf = NaN: skipped
        distance = (-log_p - entropy).abs()  # (R, V) inf for -inf logits
        sorted_distance, order = distance.sort(dim=-1, stable=True)  # (R, V) closest to typical first
        mass = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)  # (R, V) the reference's rounding
        last = (mass < self.mass).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)  # (R, 1)
        return logits.masked_fill(distance > sorted_distance.gather(-1, last), float("-inf"))  # (R, V)


#: The order the processors apply in (vLLM v1's; the module docstring). A new control adds its class here.
ORDER: tuple[type[LogitsProcessor], ...] = (GrammarMask, LogitBias, MinTokens, Penalties, MinP, TypicalP)


def build_processors(rows: Sequence[SampledRow], device: torch.device | str) -> tuple[LogitsProcessor, ...]:
    """The processors some row of the batch uses, in :data:`ORDER`; empty when none."""
    return tuple(p for p in (cls.build(rows, device) for cls in ORDER) if p is not None)


class _SeqState(Protocol):
    sampling: SamplingParams
    num_prompt_tokens: int
    history: list[int] | None
    grammar_state: GrammarState | None


def with_processors(sampling, chunks: Sequence[ScheduledChunk], states: Sequence[_SeqState],
                    device: torch.device | str, grammars: GrammarCache | None = None):
    """``sampling`` (a :class:`worker.sampler.SamplingTensors` or None) with the sampled rows' processors.

    Returns ``sampling`` itself when no sampled row uses a processor (the common case: one
    pass over the rows' host-side flags). Rows with a grammar get their matcher (created on
    first use, from ``grammars``) advanced to their latest token.
    """
    if sampling is None:
        return None
    pairs = [(chunk, state) for chunk, state in zip(chunks, states, strict=True) if chunk.sample]
    if not any(state.sampling.uses_logits_controls for _, state in pairs):
        return sampling
    rows: list[SampledRow] = []
    dead_ends: list[int] = []
    for chunk, state in pairs:
        allowed = None
        if state.sampling.grammar:
            if state.grammar_state is None:
                state.grammar_state = GrammarState(grammars.matcher(state.sampling.grammar))
            outputs = state.history[state.num_prompt_tokens:chunk.start_position + chunk.num_tokens]
            allowed = state.grammar_state.allowed(outputs, grammars, state.sampling.grammar_stop_ids)
            if not allowed.any():  # sampled unmasked (an all -inf row would make NaN), reported as a dead end
                dead_ends.append(len(rows))
                _dead_end(chunk.seq_id, len(outputs), state.grammar_state, state.sampling.grammar, grammars)
                allowed = None
        rows.append(SampledRow(state.sampling, state.num_prompt_tokens, chunk.start_position + chunk.num_tokens,
                               state.history, allowed))
    return dataclasses.replace(sampling, processors=build_processors(rows, device), dead_end_rows=tuple(dead_ends))


def _dead_end(seq_id: int, num_outputs: int, grammar_state: GrammarState, grammar: str, grammars: GrammarCache) -> None:
    """Logs a grammar's dead end (the coordinator fails the request); a failed matcher's grammar is rebuilt
    for the next sequence (:meth:`GrammarCache.forget`). Neither tokens nor the grammar reach the log."""
    error = grammar_state.error
    if error:
        grammars.forget(grammar)
    log.warning("grammar allows no token", seq_id=seq_id, num_output_tokens=num_outputs, error=error or None)


def extend_history(history: list[int], chunk: ScheduledChunk) -> None:
    """Appends a chunk's tokens to a sequence's token history (positions ``0 ..``).

    Raises:
        ValueError: the chunk does not start where the history ends.
    """
    if chunk.start_position != len(history):
        raise ValueError(f"seq_id={chunk.seq_id}: chunk at position {chunk.start_position}, "
                         f"but {len(history)} tokens of history are known")
    history.extend(chunk.token_ids)


def _ints(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
