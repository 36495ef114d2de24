"""Logprobs as the public API returns them: each token with its text, and the top alternatives.

The worker computes the numbers (worker/logprobs.py: the model's raw distribution,
before temperature, penalties and filters); the coordinator adds each token's text as it
reads after other text, its leading space kept (``" there"``) and special tokens as their
text (``"</s>"``): :meth:`Tokenizer.token_text`, so a client can show the alternatives and
the texts of a completion's tokens join into its text. A token that is part of a
multi-byte character reads U+FFFD. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.tokenizer import Tokenizer
from tpserve.step import SampleLogprobs


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    logprob: float
    text: str


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A returned token's log-probability and, most likely first, the top ``top_logprobs`` tokens."""

    token_id: int
    logprob: float
    text: str
    top_logprobs: tuple[TopLogprob, ...] = ()


def token_logprob(tokenizer: Tokenizer, token_id: int, sample: SampleLogprobs) -> TokenLogprob:
    """The public form of one sampled token's logprobs."""
    def text(tid: int) -> str:
        return tokenizer.token_text(tid)

    top = tuple(TopLogprob(tid, lp, text(tid)) for tid, lp in zip(sample.top_token_ids, sample.top_logprobs, strict=True))
    return TokenLogprob(token_id, sample.logprob, text(token_id), top)


def prompt_token_logprobs(tokenizer: Tokenizer, prompt_token_ids: list[int],
                          scored: dict[int, tuple[float, tuple[int, ...], tuple[float, ...]]]) -> tuple[TokenLogprob, ...]:
    """The public form of a sequence's prompt logprobs: one per prompt token from the second on."""
    def text(tid: int) -> str:
        return tokenizer.token_text(tid)

    out = []
    for position in range(1, len(prompt_token_ids)):
        if position not in scored:
            continue  # cannot happen: every prompt position is computed before the first token
        logprob, top_ids, top_lps = scored[position]
        token_id = prompt_token_ids[position]
        out.append(TokenLogprob(token_id, logprob, text(token_id),
                                tuple(TopLogprob(t, lp, text(t)) for t, lp in zip(top_ids, top_lps, strict=True))))
    return tuple(out)
