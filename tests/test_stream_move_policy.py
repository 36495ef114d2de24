"""The client's rules for moving a broken stream (tpserve/stream_move.py), without a server.

Live moves off a killed replica: tests/cluster/test_stream_move.py.
"""

from __future__ import annotations

import grpc
import pytest

from tpserve.stream_move import KV_TRANSFER_PARAMS_KEY, MovePolicy, StreamMove, StreamMover, with_seed
from tpserve.v1 import generate_pb2 as pb


class RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


DROPPED = RpcError(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)")


def _mover(n: int | None = None, **policy) -> tuple[StreamMover, list[StreamMove]]:
    moves: list[StreamMove] = []
    request = pb.GenerateRequest(text="Once", sampling_params=pb.SamplingParams(max_tokens=9))
    if n is not None:
        request.sampling_params.n = n
    return StreamMover(with_seed(request), MovePolicy(initial_backoff_s=0.1, on_move=moves.append, **policy)), moves


def test_a_request_without_a_seed_gets_one_and_a_given_seed_is_kept() -> None:
    drawn = with_seed(pb.GenerateRequest(text="Once"))
    assert drawn.sampling_params.HasField("seed")
    given = with_seed(pb.GenerateRequest(text="Once", sampling_params=pb.SamplingParams(seed=0)))
    assert given.sampling_params.seed == 0


def test_the_continuation_carries_every_delivered_token_once_and_the_servers_id() -> None:
    mover, moves = _mover()
    seed = mover.request.sampling_params.seed
    mover.delivered(pb.GenerateStreamResponse(request_id="req-1", token_ids=[5, 6], text="ab"))
    request, backoff = mover.next_request(DROPPED)
    assert list(request.generated_token_ids) == [5, 6] and request.request_id == "req-1"
    assert request.sampling_params.seed == seed and request.text == "Once" and 0.05 <= backoff <= 0.1
    # The second replica's messages, then a second break: the tokens of both, once each.
    message = mover.delivered(pb.GenerateStreamResponse(request_id="req-1", token_ids=[7],
                                                        prompt_logprobs=[pb.TokenLogprob(token_id=3)]))
    assert not message.prompt_logprobs  # the caller has them from the first replica
    request, backoff = mover.next_request(DROPPED)
    assert list(request.generated_token_ids) == [5, 6, 7] and 0.1 <= backoff <= 0.2
    assert [(m.attempt, m.num_delivered_tokens, m.code) for m in moves] == \
        [(1, 2, grpc.StatusCode.UNAVAILABLE), (2, 3, grpc.StatusCode.UNAVAILABLE)]


@pytest.mark.parametrize("error", [
    RpcError(grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.top_p must be in (0, 1]"),
    RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"),
    RpcError(grpc.StatusCode.CANCELLED, "cancelled"),
    RpcError(grpc.StatusCode.INTERNAL, "request req-1: rank 0 refused a grammar the coordinator accepted"),
], ids=["invalid", "deadline", "cancelled", "internal-bug"])
def test_errors_of_the_request_itself_are_raised_as_they_are(error) -> None:
    mover, moves = _mover()
    with pytest.raises(RpcError) as info:
        mover.next_request(error)
    assert info.value is error and not moves


def test_a_lost_group_moves_and_the_last_error_ends_a_stream_out_of_moves() -> None:
    mover, moves = _mover(max_moves=2)
    lost = RpcError(grpc.StatusCode.INTERNAL, "request req-1: the worker group failed: rank 1 exited")
    mover.next_request(lost)
    mover.next_request(DROPPED)
    refused = RpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
    with pytest.raises(RpcError) as info:
        mover.next_request(refused)
    assert info.value is refused and len(moves) == 2


@pytest.mark.parametrize("words", [
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host: "
    "Connection refused",
    "connections to all backends failing; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host: "
    "Connection refused",
    # A name that does not resolve (the native resolver's words, then c-ares's): it was moved four times.
    "errors resolving no-such-host.invalid:57051: [field:hostname lookup error:address lookup failed for "
    "no-such-host.invalid:57051: Domain name not found]",
    "DNS resolution failed for no-such-host.invalid:57051: C-ares status is not ARES_SUCCESS qtype=A "
    "name=no-such-host.invalid is_balancer=0: Domain name not found",
])
def test_a_first_attempt_that_reaches_no_address_is_raised_at_once(words) -> None:
    refused = RpcError(grpc.StatusCode.UNAVAILABLE, words)
    mover, moves = _mover()
    with pytest.raises(RpcError) as info:
        mover.next_request(refused)
    assert info.value is refused and not moves


def test_n_samples_do_not_move() -> None:
    mover, moves = _mover(n=2)
    with pytest.raises(RpcError):
        mover.next_request(DROPPED)
    assert not moves


def test_usage_after_a_move_is_the_usage_of_the_whole_completion() -> None:
    # The continuing server counts the 3 tokens it was given as prompt tokens (it computed, not
    # generated, them: docs/design/cluster.md, "A continuation is checked like output"); the caller sees the usage of
    # the stream it received:
    # a 4-token prompt and 3 + 2 completion tokens, as if the stream had not moved.
    mover, _ = _mover()
    mover.delivered(pb.GenerateStreamResponse(request_id="req-1", token_ids=[5, 6, 7]))
    mover.next_request(DROPPED)
    mover.delivered(pb.GenerateStreamResponse(request_id="req-1", token_ids=[8]))
    last = mover.delivered(pb.GenerateStreamResponse(
        request_id="req-1", token_ids=[9], finish_reason=pb.FINISH_REASON_LENGTH,
        usage=pb.Usage(prompt_tokens=4 + 3, completion_tokens=2, cached_prompt_tokens=4)))
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_prompt_tokens) == (4, 5, 4)
    # A cached prefix that reaches into the continued tokens (a 16-token block of prompt + continuation) counts
    # the original prompt's tokens only: cached_prompt_tokens was 16 against prompt_tokens 5 (a 320 % hit rate).
    mover, _ = _mover()
    mover.delivered(pb.GenerateStreamResponse(request_id="req-1", token_ids=list(range(20, 41))))
    mover.next_request(DROPPED)
    last = mover.delivered(pb.GenerateStreamResponse(
        request_id="req-1", token_ids=[9], finish_reason=pb.FINISH_REASON_LENGTH,
        usage=pb.Usage(prompt_tokens=4 + 21, completion_tokens=1, cached_prompt_tokens=16),
        timings=pb.RequestTimings(cached_prompt_tokens=16)))
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_prompt_tokens) == (4, 22, 4)
    assert last.timings.cached_prompt_tokens == 4
    # An unmoved stream's usage is the server's, as it is.
    mover, _ = _mover()
    last = mover.delivered(pb.GenerateStreamResponse(token_ids=[9], finish_reason=pb.FINISH_REASON_LENGTH,
                                                     usage=pb.Usage(prompt_tokens=4, completion_tokens=1)))
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 1)


class _MovedOut(RpcError):
    """A draining replica's UNAVAILABLE with its KV hand-off (coordinator/kv_transfer/stream_moves.py)."""

    def __init__(self, handoff: str | None) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, "request r: this server is draining")
        self._trailing = () if handoff is None else ((KV_TRANSFER_PARAMS_KEY, handoff),)

    def trailing_metadata(self):
        return self._trailing


def test_a_hand_off_in_the_trailing_metadata_goes_with_the_next_attempt_only() -> None:
    mover, _ = _mover()
    mover.metadata = (("authorization", "Bearer k"),)
    mover.next_request(_MovedOut('{"do_remote_prefill": true}'))
    assert mover.metadata == (("authorization", "Bearer k"), (KV_TRANSFER_PARAMS_KEY, '{"do_remote_prefill": true}'))
    mover.next_request(_MovedOut(None))  # the next break carries none: the old hand-off is not sent again
    assert mover.metadata == (("authorization", "Bearer k"),)
    mover.next_request(DROPPED)  # an error without trailing metadata at all
    assert mover.metadata == (("authorization", "Bearer k"),)


class _BrokenCall:
    """A call that delivers one message, then breaks as a replica that went away."""

    def __init__(self) -> None:
        self.sent = [pb.GenerateStreamResponse(request_id="req-1", text="Once", token_ids=[5])]

    def __iter__(self):
        return self

    def __next__(self):
        if self.sent:
            return self.sent.pop()
        raise DROPPED

    async def _messages(self):
        while self.sent:
            yield self.sent.pop()
        raise DROPPED

    def __aiter__(self):
        return self._messages()

    def cancel(self) -> bool:
        return False  # it has ended


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_cancel_during_the_backoff_of_a_move_ends_the_stream_and_starts_no_continuation(asynchronous: bool) -> None:
    """``cancel()`` went to the attempt that had failed (False, nothing cancelled) and the continuation started after
    the backoff all the same, running to its end on the next replica."""
    import asyncio
    import threading

    from tpserve.client_streams import AsyncGenerateStream, GenerateStream

    started: list[pb.GenerateRequest] = []
    moves: list[StreamMove] = []
    request = with_seed(pb.GenerateRequest(text="Once", sampling_params=pb.SamplingParams(max_tokens=9)))
    mover = StreamMover(request, MovePolicy(initial_backoff_s=0.5, max_backoff_s=0.5, on_move=moves.append))
    kind = AsyncGenerateStream if asynchronous else GenerateStream
    stream = kind(_BrokenCall(), mover, lambda request, timeout: started.append(request))
    cancelled: list[bool] = []

    def cancel_in_the_backoff() -> None:
        while not moves:  # the move is decided: the backoff has begun
            threading.Event().wait(0.01)
        cancelled.append(stream.cancel())

    canceller = threading.Thread(target=cancel_in_the_backoff)
    canceller.start()
    with pytest.raises(grpc.RpcError) as ended:
        if asynchronous:
            async def read() -> None:
                async for _ in stream:
                    pass

            asyncio.run(read())
        else:
            for _ in stream:
                pass
    canceller.join(5)
    assert ended.value.code() == grpc.StatusCode.CANCELLED
    assert "cancelled while the stream was moving to another replica" in ended.value.details()
    assert cancelled == [True] and not started


def test_an_abort_during_the_backoff_of_a_move_ends_the_stream_and_starts_no_continuation() -> None:
    """``client.abort(id)`` reached every replica, none ran the stream at that instant (0), and the continuation
    started a moment later ran to its end: the client now ends its own moving streams of those ids."""
    import threading

    from tpserve.client import Client
    from tpserve.client_streams import GenerateStream

    started: list[pb.GenerateRequest] = []
    moves: list[StreamMove] = []
    request = with_seed(pb.GenerateRequest(text="Once", request_id="req-1",
                                           sampling_params=pb.SamplingParams(max_tokens=9)))
    mover = StreamMover(request, MovePolicy(initial_backoff_s=0.5, max_backoff_s=0.5, on_move=moves.append))
    stream = GenerateStream(_BrokenCall(), mover, lambda request, timeout: started.append(request))
    with Client("127.0.0.1:1") as client:
        client._streams.add(stream)
        assert client._abort_moving(["req-1"]) == 0  # not moving yet: a server's abort is what ends it
        ended: list[int] = []

        def abort_in_the_backoff() -> None:
            while not moves:
                threading.Event().wait(0.01)
            ended.append(client._abort_moving(["req-2", "req-1"]))

        aborter = threading.Thread(target=abort_in_the_backoff)
        aborter.start()
        with pytest.raises(grpc.RpcError) as error:
            for _ in stream:
                pass
        aborter.join(5)
    assert error.value.code() == grpc.StatusCode.CANCELLED
    assert "aborted (abort) while the stream was moving to another replica" in error.value.details()
    assert ended == [1] and not started
