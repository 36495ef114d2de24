"""What one forward pass and its sampling produce on a rank, before it becomes a :class:`~tpserve.step.StepResult`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpserve.step import PromptLogprobs, SampleLogprobs


@dataclass(frozen=True)
class StepOutput:
    """The model runner's result of one step (rank 0 fills the sampled fields; other ranks leave them empty).

    Attributes:
        sampled_token_ids: one token per chunk with ``sample=True``, in plan order; a chunk
            with proposals gives ``1 + num_accepted_tokens[i]`` consecutive tokens.
        logprobs: for the samples whose sequence asked, in sample order.
        prompt_logprobs: for the chunks whose sequence asked for prompt logprobs.
        num_accepted_tokens: with proposals in the step, one count per sampled chunk; else empty.
        logits: ``(N, vocab) float32`` the sampled rows' raw logits on rank 0; None otherwise.
        spec_logits: ``(S, vocab) float32`` the verification rows' logits; None without proposals.
        num_padding_rows: rows a replayed CUDA graph ran beyond the step's sequences.
    """

    sampled_token_ids: tuple[int, ...] = ()
    logprobs: tuple[SampleLogprobs, ...] = ()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    num_accepted_tokens: tuple[int, ...] = ()
    logits: torch.Tensor | None = None
    spec_logits: torch.Tensor | None = None
    num_padding_rows: int = 0
