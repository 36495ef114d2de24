"""Log-probabilities of sampled tokens, for the rows that ask for them (rank 0).

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

from tpserve.step import SampleLogprobs, SamplingParams


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
