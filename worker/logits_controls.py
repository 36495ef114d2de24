"""Logits controls of the sampling rank: logit_bias, min_tokens, penalties and min_p (vLLM's semantics).

Order, as vLLM's v1 sampler applies them to a row of float32 logits:

0. a structured-output grammar's mask (worker/grammar.py): disallowed tokens ``-inf``;
1. ``logit_bias``: ``logits[v] += bias[v]``;
2. ``min_tokens``: while fewer than ``min_tokens`` tokens are generated, the stop
   tokens (eos unless ignored, stop token ids) get ``-inf``;
3. penalties, with ``prompt`` and ``output`` the sequence's tokens so far:
   ``repetition_penalty`` r on every token of prompt or output (CTRL, Keskar et al.
   2019, arXiv:1909.05858: ``l / r`` where ``l > 0``, else ``l * r``), then
   ``l -= frequency_penalty * count_output(v)`` and
   ``l -= presence_penalty * (count_output(v) > 0)`` (OpenAI's definition).
   Greedy rows take their argmax here;
4. after the temperature: ``min_p`` drops tokens whose probability is below
   ``min_p * max probability`` (Nguyen et al. 2024, arXiv:2407.01082), before top-k/top-p.

A batch pays for this only when one of its sampled rows asks for a control
(``SamplingTensors.controls`` is None otherwise: one ``any`` over the rows' flags on
the host). Each row's tensors are built from its own tokens only, so a request's
tokens do not depend on what else shares its batch. The token history (needed by the
penalties) is kept on the sampling rank for the sequences that use a penalty: the
coordinator sends what the rank never sees in a chunk (``NewSequence.history_token_ids``,
a cached prefix) and every chunk's tokens are appended (:func:`extend_history`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tpserve.step import SamplingParams, ScheduledChunk
from worker.grammar import GrammarCache, GrammarState


@dataclass(frozen=True)
class LogitsControls:
    """The controls of a batch's ``N`` sampled rows, as sparse device tensors.

    Attributes:
        bias_rows, bias_ids, bias_values: ``(B,) int64, (B,) int64, (B,) float32``
            logit_bias entries; None when no row has one.
        ban_rows, ban_ids: ``(K,) int64`` (row, token) pairs set to ``-inf``
            (min_tokens not reached yet); None when none.
        penalized: whether the penalty fields below are set.
        repetition, presence, frequency: ``(N, 1) float32`` per-row penalties
            (neutral 1, 0, 0 for rows without).
        seen_rows, seen_ids: ``(S,) int64`` the distinct tokens of each row's prompt
            and output (the repetition penalty's set).
        output_rows, output_ids, output_counts: ``(O,)`` each row's distinct output
            tokens and how often each occurs (float32).
        min_p: ``(N,) float32``; None when no row uses it.
        grammar_rows, grammar_allowed: ``(G,) int64`` rows with a grammar and their
            ``(G, V) bool`` allowed tokens; None when no row has one.
    """

    bias_rows: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    ban_rows: torch.Tensor | None = None
    ban_ids: torch.Tensor | None = None
    penalized: bool = False
    repetition: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    seen_rows: torch.Tensor | None = None
    seen_ids: torch.Tensor | None = None
    output_rows: torch.Tensor | None = None
    output_ids: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    grammar_rows: torch.Tensor | None = None
    grammar_allowed: torch.Tensor | None = None


class _SeqState(Protocol):
    sampling: SamplingParams
    num_prompt_tokens: int
    history: list[int] | None
    grammar_state: GrammarState | None


def extend_history(history: list[int], chunk: ScheduledChunk) -> None:
    """Appends a chunk's tokens to a sequence's token history (positions ``0 ..``).

    Raises:
        ValueError: the chunk does not start where the history ends.
    """
    if chunk.start_position != len(history):
        raise ValueError(f"seq_id={chunk.seq_id}: chunk at position {chunk.start_position}, "
                         f"but {len(history)} tokens of history are known")
    history.extend(chunk.token_ids)


def build_logits_controls(params: Sequence[SamplingParams], num_prompt_tokens: Sequence[int],
                          positions: Sequence[int], histories: Sequence[Sequence[int] | None],
                          device: torch.device | str,
                          grammar_masks: Sequence[tuple[int, np.ndarray]] = ()) -> LogitsControls | None:
    """The controls of ``N`` sampled rows, or None when no row uses any.

    Args:
        params: each row's sampling parameters.
        num_prompt_tokens: each row's prompt length.
        positions: position of the token each row samples (= tokens before it).
        histories: each row's tokens at positions ``0 .. positions[i] - 1`` (required
            for rows with a penalty; None otherwise).
        device: the logits' device.
        grammar_masks: ``(row, (V,) bool allowed tokens)`` of the rows with a grammar.
    """
    if not any(p.uses_logits_controls for p in params):
        return None
    bias = [(row, token, value) for row, p in enumerate(params) for token, value in p.logit_bias]
    bans = [(row, token) for row, (p, pos, n) in enumerate(zip(params, positions, num_prompt_tokens, strict=True))
            if pos - n < p.min_tokens for token in p.min_tokens_stop_ids]
    fields: dict = {}
    if bias:
        rows, ids, values = zip(*bias)
        fields.update(bias_rows=_ints(rows, device), bias_ids=_ints(ids, device),
                      bias_values=torch.tensor(values, dtype=torch.float32, device=device))
    if bans:
        rows, ids = zip(*bans)
        fields.update(ban_rows=_ints(rows, device), ban_ids=_ints(ids, device))
    if any(p.uses_penalties for p in params):
        seen: list[tuple[int, int]] = []
        counted: list[tuple[int, int, int]] = []
        for row, (p, n, pos, history) in enumerate(zip(params, num_prompt_tokens, positions, histories, strict=True)):
            if not p.uses_penalties:
                continue
            if history is None or len(history) < pos:
                raise ValueError(f"row {row} uses a penalty but {0 if history is None else len(history)} of its "
                                 f"{pos} tokens are known")
            output = Counter(history[n:pos])
            seen += [(row, t) for t in set(history[:pos])]
            counted += [(row, t, c) for t, c in output.items()]
        s_rows, s_ids = zip(*seen) if seen else ((), ())
        o_rows, o_ids, o_counts = zip(*counted) if counted else ((), (), ())
        column = [(p.repetition_penalty, p.presence_penalty, p.frequency_penalty) for p in params]
        penalties = torch.tensor(column, dtype=torch.float32, device=device)  # (N, 3)
        fields.update(
            penalized=True, repetition=penalties[:, 0:1], presence=penalties[:, 1:2], frequency=penalties[:, 2:3],
            seen_rows=_ints(s_rows, device), seen_ids=_ints(s_ids, device),
            output_rows=_ints(o_rows, device), output_ids=_ints(o_ids, device),
            output_counts=torch.tensor(o_counts, dtype=torch.float32, device=device))
    if any(p.min_p > 0.0 for p in params):
        fields["min_p"] = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    if grammar_masks:
        rows, masks = zip(*grammar_masks)
        fields.update(grammar_rows=_ints(rows, device), grammar_allowed=torch.from_numpy(np.stack(masks)).to(device))
    return LogitsControls(**fields)


def with_logits_controls(sampling, chunks: Sequence[ScheduledChunk], states: Sequence[_SeqState],
                         device: torch.device | str, grammars: GrammarCache | None = None):
    """``sampling`` (a :class:`worker.sampler.SamplingTensors` or None) with the sampled rows' controls attached.

    Returns ``sampling`` itself when no sampled row uses a control (the common case:
    one pass over the rows' host-side flags). Rows with a grammar get their matcher
    (created on first use, from ``grammars``) advanced to their latest token.
    """
    if sampling is None:
        return None
    rows = [(chunk, state) for chunk, state in zip(chunks, states, strict=True) if chunk.sample]
    if not any(state.sampling.uses_logits_controls for _, state in rows):
        return sampling
    grammar_masks = []
    for row, (chunk, state) in enumerate(rows):
        if state.sampling.grammar:
            if state.grammar_state is None:
                state.grammar_state = GrammarState(grammars.matcher(state.sampling.grammar))
            outputs = state.history[state.num_prompt_tokens:chunk.start_position + chunk.num_tokens]
            allowed = state.grammar_state.allowed(outputs, grammars, state.sampling.grammar_stop_ids)
            grammar_masks.append((row, allowed))
    controls = build_logits_controls(
        [s.sampling for _, s in rows], [s.num_prompt_tokens for _, s in rows],
        [c.start_position + c.num_tokens for c, _ in rows], [s.history for _, s in rows], device, grammar_masks)
    return dataclasses.replace(sampling, controls=controls)


def apply_logits_controls(logits: torch.Tensor, controls: LogitsControls) -> torch.Tensor:
    """Steps 1 to 3 of the module docstring (bias, min_tokens, penalties), before any argmax.

    Args:
        logits: ``(N, V)`` float32 (not modified).
        controls: the rows' controls, on ``logits.device``.

    Returns:
        ``(N, V)`` float32.
    """
    logits = logits.clone()  # (N, V) the caller's logits stay the model's (last_logits, logprobs)
    if controls.grammar_rows is not None:
        allowed = controls.grammar_allowed[:, :logits.shape[-1]]  # (G, V)
        logits[controls.grammar_rows] = logits[controls.grammar_rows].masked_fill(~allowed, float("-inf"))
    if controls.bias_rows is not None:
        logits.index_put_((controls.bias_rows, controls.bias_ids), controls.bias_values, accumulate=True)
    if controls.ban_rows is not None:
        logits.index_put_((controls.ban_rows, controls.ban_ids),
                          torch.tensor(float("-inf"), device=logits.device))
    if controls.penalized:
        seen = torch.zeros_like(logits, dtype=torch.bool)  # (N, V) in the prompt or the output
        seen[controls.seen_rows, controls.seen_ids] = True
        counts = torch.zeros_like(logits)  # (N, V) occurrences in the output
        counts[controls.output_rows, controls.output_ids] = controls.output_counts
        repetition = torch.where(seen, controls.repetition, 1.0)  # (N, V)
        logits = torch.where(logits > 0, logits / repetition, logits * repetition)  # (N, V)
        logits = logits - controls.frequency * counts - controls.presence * (counts > 0)  # (N, V)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Step 4: ``-inf`` for tokens whose probability is below ``min_p`` times the row's largest.

    Args:
        logits: ``(N, V)`` float32, already divided by the temperature.
        min_p: ``(N,) float32`` in [0, 1]; 0 keeps every token.

    Returns:
        ``(N, V)`` float32, the kept logits unchanged.
    """
    probs = logits.softmax(dim=-1)  # (N, V)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # (N, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))  # (N, V)


def _ints(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
