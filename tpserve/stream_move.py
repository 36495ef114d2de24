"""Moving a broken stream to another replica: when, how often, and the request that continues it.

A stream that breaks because its server went away (``UNAVAILABLE``: the connection
dropped, the server is draining or restarting its worker group; ``INTERNAL`` from a lost
worker group) is sent again with the completion tokens it has delivered as the request's
``generated_token_ids``. The server then treats them as its own earlier output (positions,
seeded noise, penalties, ``min_tokens``, stop strings across the seam, grammar state), so
the rest of the stream is token for token what the first server would have sent
(proto/tpserve/v1/generate.proto). The client's channel balances with ``round_robin``
over the target's addresses, which picks only connected ones: a replica that is gone is
skipped, so the next attempt lands on another address.

Such a continuation needs the first attempt's seed, so a request without one gets a
random seed from the client before its first send (the server would draw one the same
way). A request with ``n`` > 1 does not move (each sample has its own output; the field
needs ``n`` = 1): its error is raised as it is.

Usage after a move: the server that continues a stream counts the tokens it was given as
prompt tokens (it computed them as a prompt; it did not generate them) and only its own
tokens as completion tokens. The mover gives the caller the usage of the completion it
received instead: those tokens move back from ``prompt_tokens`` to ``completion_tokens``,
so a moved stream reports the prompt and completion counts the same stream unmoved would (the
servers' own counts, in their metrics, are what each computed). ``cached_prompt_tokens`` is the
continuing server's: how many of the original prompt's tokens it did not compute (its prefix cache
hits, or the KV moved with the stream), at most the prompt's length. The first server's count is not
known to the mover (usage comes with a stream's last message only), so it may differ from an unmoved
stream's.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from tpserve.v1 import generate_pb2 as pb

log = logging.getLogger("tpserve.client")

SEED_RANGE = 2**64  # SamplingParams.seed: any unsigned 64-bit value
#: Trailing metadata of a stream a draining replica moved out with its KV (coordinator/kv_transfer/stream_moves.py),
#: sent back as call metadata with the continuation, so that the next replica pulls the blocks.
KV_TRANSFER_PARAMS_KEY = "x-tpserve-kv-transfer-params"

#: INTERNAL details that mean the server lost its workers or the transport broke, not a bug in the request.
_LOST_GROUP_MARKERS = ("worker group", "engine loop failed", "rst_stream", "stream removed")
#: gRPC's UNAVAILABLE when no address of the target accepts a connection at all (pick_first's and round_robin's words),
#: or the target's name resolves to none (the native resolver's words, c-ares's).
_NO_ADDRESS = ("failed to connect to all addresses", "connections to all backends failing", "errors resolving",
               "dns resolution failed")


@dataclass(frozen=True, slots=True)
class StreamMove:
    """One move of a stream, as :attr:`MovePolicy.on_move` receives it.

    Attributes:
        request_id: the request's id (the server's, when the caller gave none).
        attempt: 1 for the first move, 2 for the second, ...
        num_delivered_tokens: completion tokens delivered before the break, sent as
            ``generated_token_ids``.
        code, details: the status that broke the stream.
        backoff_s: seconds waited before the new attempt.
    """

    request_id: str
    attempt: int
    num_delivered_tokens: int
    code: grpc.StatusCode
    details: str
    backoff_s: float


@dataclass(frozen=True)
class MovePolicy:
    """How a client moves broken streams.

    Attributes:
        max_moves: most new attempts per request (0: never move); past them the last error is raised.
        initial_backoff_s, max_backoff_s: the wait before attempt i is
            ``min(initial_backoff_s * 2**(i-1), max_backoff_s)`` seconds, times a random
            factor in [0.5, 1] (jitter, so that many streams broken at once do not retry in step).
        on_move: called once per move, before the wait (also logged at INFO on ``tpserve.client``).
    """

    max_moves: int = 4
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    on_move: Callable[[StreamMove], None] | None = None


def is_movable(exc: grpc.RpcError) -> bool:
    """Whether a stream that failed with ``exc`` may continue on another replica."""
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    return code == grpc.StatusCode.INTERNAL and any(m in (exc.details() or "").lower() for m in _LOST_GROUP_MARKERS)


def with_seed(request: pb.GenerateRequest) -> pb.GenerateRequest:
    """``request`` with a random seed if it has none, so that a continuation draws the same noise."""
    if not request.sampling_params.HasField("seed"):
        request.sampling_params.seed = random.randrange(SEED_RANGE)
    return request


class StreamMover:
    """The state of one moving stream: the tokens delivered, the moves made.

    ``delivered(message)`` is called with each message received; ``next_request(exc)``
    after a failure returns the request to send next and the seconds to wait first, or
    raises ``exc`` when the stream cannot move (not a movable error, ``n`` > 1, out of moves,
    or a first attempt that reached no address of the target at all).
    """

    def __init__(self, request: pb.GenerateRequest, policy: MovePolicy,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.request = request
        self.metadata = trace_metadata(metadata)  # every attempt's call metadata: one trace follows the stream
        self.policy = policy
        self.tokens: list[int] = []
        self.moves = 0
        self.finished = False
        self._num_continued = 0  # tokens the current attempt was sent as generated_token_ids
        self._movable = not (request.sampling_params.HasField("n") and request.sampling_params.n > 1)

    def delivered(self, message: pb.GenerateStreamResponse) -> pb.GenerateStreamResponse:
        """Records a received message; on a moved stream, drops the prompt logprobs the caller already has."""
        if not self.request.request_id and message.request_id:
            self.request.request_id = message.request_id  # the continuation keeps the server's id
        self.tokens.extend(message.token_ids)
        if message.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finished = True
        if self.moves and message.prompt_logprobs:
            del message.prompt_logprobs[:]
        if self._num_continued and message.HasField("usage"):  # the caller's completion, not this server's share
            moved = min(self._num_continued, message.usage.prompt_tokens)  # never below 0 (uint32)
            message.usage.prompt_tokens -= moved
            message.usage.completion_tokens += moved
            # The server's cached prefix may reach into the continued tokens: of the original prompt's, at most all.
            message.usage.cached_prompt_tokens = min(message.usage.cached_prompt_tokens, message.usage.prompt_tokens)
            if message.HasField("timings"):
                message.timings.cached_prompt_tokens = min(message.timings.cached_prompt_tokens,
                                                           message.usage.prompt_tokens)
        return message

    def next_request(self, exc: grpc.RpcError) -> tuple[pb.GenerateRequest, float]:
        """The continuation to send after ``exc`` and the backoff in seconds.

        Raises:
            grpc.RpcError: ``exc`` itself, when the stream cannot move.
        """
        if self.finished or not self._movable or self.moves >= self.policy.max_moves or not is_movable(exc):
            raise exc
        if not self.tokens and not self.moves and any(m in (exc.details() or "").lower() for m in _NO_ADDRESS):
            raise exc  # never reached a server: no replica to move to (a wrong --target says so at once)
        self.moves += 1
        backoff = min(self.policy.initial_backoff_s * 2 ** (self.moves - 1), self.policy.max_backoff_s)
        backoff *= random.uniform(0.5, 1.0)
        move = StreamMove(self.request.request_id, self.moves, len(self.tokens), exc.code(), exc.details() or "",
                          backoff)
        log.info("stream moved to another replica: request_id=%s attempt=%d delivered_tokens=%d after %s: %s",
                 move.request_id, move.attempt, move.num_delivered_tokens, move.code.name, move.details)
        if self.policy.on_move is not None:
            self.policy.on_move(move)
        # The old replica's KV hand-off, when it moved the stream out with its blocks (the next replica pulls them).
        trailing = getattr(exc, "trailing_metadata", None)
        handoff = [(k, v) for k, v in ((trailing() if callable(trailing) else None) or ()) if k == KV_TRANSFER_PARAMS_KEY]
        self.metadata = tuple(m for m in self.metadata if m[0] != KV_TRANSFER_PARAMS_KEY) + tuple(handoff)
        request = pb.GenerateRequest()
        request.CopyFrom(self.request)
        del request.generated_token_ids[:]
        request.generated_token_ids.extend(self.tokens)
        self._num_continued = len(self.tokens)
        return request, backoff


def trace_metadata(metadata: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """``metadata`` plus the caller's current OpenTelemetry trace context (``traceparent``,
    ``tracestate``) when the caller uses OpenTelemetry (imported it); ``metadata`` itself
    otherwise. Taken once per request: a stream that moves to another replica
    (:mod:`tpserve.stream_move`) sends the same ``traceparent`` again, so one trace follows it."""
    if "opentelemetry.trace" not in sys.modules:  # the caller does not trace: nothing to do, nothing imported
        return metadata
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    extra = tuple((key, value) for key, value in carrier.items() if key in ("traceparent", "tracestate"))
    return metadata + extra if extra else metadata
