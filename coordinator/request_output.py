"""What the engine hands a request's handler: one :class:`RequestOutput` per step (or merged).

Its own module so that code which only builds or reads outputs (the request table's
abort of a request not yet queued, the output collector, the protocol edges) needs no
engine. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from coordinator.logprobs import TokenLogprob
from coordinator.sequence import FinishReason

if TYPE_CHECKING:
    from coordinator.request_timings import RequestTimings


# Not frozen: a frozen slots dataclass's __init__ costs 4x, once per token (docs/design/request-path.md).
@dataclass(slots=True)
class RequestOutput:
    """What one step added to one request (not changed once put on the request's queue).

    Attributes:
        request_id: the request.
        text: new text since the previous output (may be empty while held back).
        token_ids: new token ids since the previous output (stopping token excluded).
        finish_reason: set on the request's last output.
        num_prompt_tokens, num_completion_tokens: usage so far, in tokens.
        num_cached_prompt_tokens: prompt tokens found in the prefix cache (not computed).
        logprobs: one per entry of ``token_ids`` when the request asked for logprobs.
        prompt_logprobs: on the first output of a request that asked: one per prompt
            token from the second on.
        timings: on the last output, where the sample's time went
            (coordinator/request_timeline.py); None before.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_prompt_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    timings: RequestTimings | None = None


def aborted_output(request_id: str, num_prompt_tokens: int) -> RequestOutput:
    """The only output of a sample aborted before the engine queued it: no token, finish_reason ABORT.

    Args:
        request_id: the request's id.
        num_prompt_tokens: its prompt's length in tokens (0 when aborted before it was tokenized).
    """
    return RequestOutput(request_id, "", [], FinishReason.ABORT, num_prompt_tokens, 0)
