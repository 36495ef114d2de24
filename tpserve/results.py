"""What a finished request reports besides its text: usage in tokens, and where its time went.

The client's result objects (:class:`GenerateResult`, the last :class:`StreamChunk` of a
stream; both re-exported by :mod:`tpserve.client`) carry them; ``tpserve generate --json``
prints them. The server fills them from the request's timeline (coordinator/request_timeline.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tpserve.v1 import generate_pb2 as pb


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # of prompt_tokens, found in the server's prefix cache


@dataclass(frozen=True, slots=True)
class Timings:
    """Where one request's time went on the replica that finished it, in seconds (the server's
    clock, from its receipt of the request): ``queue_time_s + prefill_time_s + decode_time_s``
    is its time on the server, the caller's wall time less the network.

    Attributes:
        queue_time_s: received until first scheduled (validation, grammar, waiting for a slot).
        prefill_time_s: first scheduled until the first token.
        decode_time_s: first token until the last message.
        time_to_first_token_s: received until the first token (0: none came).
        num_preemptions: times the server took its KV cache back and recomputed it.
        cached_prompt_tokens: prompt tokens found in the server's prefix cache.
        replica: which replica served it, ``<served model name>@<pod or host name>``.
    """

    queue_time_s: float
    prefill_time_s: float
    decode_time_s: float
    time_to_first_token_s: float
    num_preemptions: int
    cached_prompt_tokens: int
    replica: str

    @property
    def e2e_time_s(self) -> float:
        """The request's time on the server: queue + prefill + decode."""
        return self.queue_time_s + self.prefill_time_s + self.decode_time_s

    def to_json_dict(self) -> dict:
        """The ``timings`` object of ``tpserve generate --json``."""
        return asdict(self)


def timings_of(message: pb.GenerateResponse | pb.GenerateStreamResponse) -> Timings | None:
    """A response's timings; None when it has none (a message before the last, an older server)."""
    if not message.HasField("timings"):
        return None
    t = message.timings
    return Timings(t.queue_time_s, t.prefill_time_s, t.decode_time_s, t.time_to_first_token_s, t.num_preemptions,
                   t.cached_prompt_tokens, t.replica)


FINISH_REASON_NAMES = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A finished completion: text, token ids, "stop" | "length" | "abort", usage in tokens, (when
    asked for) one ``TokenLogprob`` per token id, and where its time went on the server (``timings``)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage
    logprobs: tuple[pb.TokenLogprob, ...] = ()
    prompt_logprobs: tuple[pb.TokenLogprob, ...] = ()
    timings: Timings | None = None  # None from a server older than RequestTimings

    def to_json_dict(self) -> dict:
        """The ``tpserve generate --json`` object."""
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": {"prompt_tokens": self.usage.prompt_tokens, "completion_tokens": self.usage.completion_tokens,
                      "cached_prompt_tokens": self.usage.cached_prompt_tokens},
            **({"timings": self.timings.to_json_dict()} if self.timings is not None else {})}


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """One message of a stream: the text and token ids generated since the previous one. The last
    message carries ``finish_reason`` ("stop" | "length" | "abort"), ``usage`` and ``timings``; before it
    they are None. ``logprobs``: one ``TokenLogprob`` per token id, when asked for."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: tuple[pb.TokenLogprob, ...] = ()
    prompt_logprobs: tuple[pb.TokenLogprob, ...] = ()
    index: int = 0  # the sample (with n > 1), in [0, n)
    timings: Timings | None = None


def chunk_of(response: pb.GenerateStreamResponse) -> StreamChunk:
    """One message as a StreamChunk: a message per token per stream, so the usual one (mid-stream, no
    logprobs) skips the fields it does not carry (2.6 -> 1.8 µs); usage comes only with a finish reason."""
    if not response.finish_reason and not response.logprobs and not response.prompt_logprobs:
        return StreamChunk(response.request_id, response.text, list(response.token_ids), None, None, (), (),
                           response.index)
    return StreamChunk(
        request_id=response.request_id, text=response.text, token_ids=list(response.token_ids),
        finish_reason=FINISH_REASON_NAMES[response.finish_reason],
        usage=(Usage(response.usage.prompt_tokens, response.usage.completion_tokens,
                     response.usage.cached_prompt_tokens) if response.HasField("usage") else None),
        logprobs=tuple(response.logprobs), prompt_logprobs=tuple(response.prompt_logprobs), index=response.index,
        timings=timings_of(response))


def result_of(response: pb.GenerateResponse) -> GenerateResult:
    """A unary Generate response as a GenerateResult."""
    return GenerateResult(
        request_id=response.request_id, text=response.text, token_ids=list(response.token_ids),
        finish_reason=FINISH_REASON_NAMES[response.finish_reason],
        usage=Usage(response.usage.prompt_tokens, response.usage.completion_tokens,
                    response.usage.cached_prompt_tokens), logprobs=tuple(response.logprobs),
        prompt_logprobs=tuple(response.prompt_logprobs), timings=timings_of(response))
