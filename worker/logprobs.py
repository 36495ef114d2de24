"""Log-probabilities of sampled tokens and of prompt tokens, for the sequences that ask (rank 0).

Which distribution: the model's raw one, ``log_softmax`` of the float32 logits
before any logits control, temperature or filter (vLLM's default,
``logprobs_mode=raw_logprobs``; OpenAI's ``logprobs``). So a request's logprobs do
not change with its temperature or penalties, and they are what a client needs to
score text under the model.

A step where no sampled row asks pays one ``any`` over the rows' flags on the host.
Otherwise only the asking rows are normalised, with one ``top-k`` of the largest
``top_logprobs`` among them, and copied to the host together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tpserve.step import PromptLogprobs, SampleLogprobs, SamplingParams, ScheduledChunk


def sample_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                    params: Sequence[SamplingParams]) -> tuple[SampleLogprobs, ...]:
    """The logprobs of the sampled tokens of the rows whose ``params.logprobs`` is set.

    Args:
        logits: ``(N, V)`` float32 raw logits of the step's samples.
        tokens: ``(N,) int64`` the sampled tokens.
        params: each row's sampling parameters.

    Returns:
        One :class:`SampleLogprobs` per asking row, in row order; empty when none asks.
    """
    rows = [row for row, p in enumerate(params) if p.logprobs]
    if not rows:
        return ()
    index = torch.tensor(rows, device=logits.device)  # (R,)
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)  # (R, V)
    chosen = logprobs.gather(1, tokens[index][:, None])  # (R, 1)
    k = max(params[row].top_logprobs for row in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())  # (R, k)
    # float64 holds the float32 values and the token ids (< 2**53) exactly: one copy to the host.
    host = torch.cat([chosen.double(), top_values.double(), top_ids.double()], dim=1).tolist()  # (R, 1 + 2k)
    out = []
    for row, values in zip(rows, host, strict=True):
        n = params[row].top_logprobs
        out.append(SampleLogprobs(row, values[0], tuple(int(t) for t in values[1 + k:1 + k + n]),
                                  tuple(values[1:1 + n])))
    return tuple(out)


def prompt_logprobs(model, hidden: torch.Tensor, chunks: Sequence[ScheduledChunk], states: Sequence,
                    last_rows: Sequence[int]) -> tuple[PromptLogprobs, ...]:
    """Log-probabilities of the prompt tokens this step's chunks cover, for sequences that ask.

    Called on every rank with the same arguments: the extra LM-head rows are a collective
    (their logits are gathered to rank 0), so whether to compute them depends only on
    the plan and the sequences' sampling parameters, which every rank has.

    Args:
        model: the runner's model (``compute_logits`` of ``(R, hidden)`` rows).
        hidden: ``(T, hidden)`` the step's final hidden states.
        chunks: the plan's chunks; ``states``: their sequences' runner states
            (``sampling``, ``num_prompt_tokens``, ``prompt_token_ids``).
        last_rows: row of each chunk's last token (``StepInputs.chunk_last_rows``).

    Returns:
        One :class:`PromptLogprobs` per asking chunk on rank 0; empty elsewhere or when none asks.
    """
    specs = []  # (chunk, state, first scored position, rows)
    for chunk, state, last in zip(chunks, states, last_rows, strict=True):
        if state.sampling.prompt_logprobs is None:
            continue
        # Row of position p scores the token at p + 1; prompt tokens 1 .. n - 1 are scored.
        first = max(chunk.start_position, 0) + 1
        end = min(chunk.start_position + chunk.num_tokens, state.num_prompt_tokens - 1) + 1  # exclusive
        if first >= end:
            continue
        first_row = last - chunk.num_tokens + 1 + (first - 1 - chunk.start_position)
        specs.append((chunk, state, first, list(range(first_row, first_row + end - first))))
    if not specs:
        return ()
    rows = torch.tensor([r for *_, rs in specs for r in rs], device=hidden.device)  # (R,)
    logits = model.compute_logits(hidden[rows])  # (R, V) on rank 0, None elsewhere: a collective
    if logits is None:
        return ()
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
    targets = torch.tensor([t for _, state, first, rs in specs
                            for t in state.prompt_token_ids[first:first + len(rs)]], device=logits.device)  # (R,)
    chosen = logprobs.gather(1, targets[:, None])  # (R, 1)
    k = max(state.sampling.prompt_logprobs for _, state, _, _ in specs)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())  # (R, k)
    host = torch.cat([chosen.double(), top_values.double(), top_ids.double()], dim=1).tolist()  # one copy
    out, offset = [], 0
    for chunk, state, first, rs in specs:
        n = state.sampling.prompt_logprobs
        values = host[offset:offset + len(rs)]
        offset += len(rs)
        out.append(PromptLogprobs(chunk.seq_id, first, tuple(v[0] for v in values),
                                  tuple(tuple(int(t) for t in v[1 + k:1 + k + n]) for v in values),
                                  tuple(tuple(v[1:1 + n]) for v in values)))
    return tuple(out)
