"""Streams that move to another replica, token for token (docs/design/cluster.md, "A broken stream moves to another
replica"), on stories260k.

Two replicas (separate ``tpserve serve`` processes, each in a process group of its own)
stand behind one ``ipv4:`` target. First, on the replica that is never faulted: a
request continued from k delivered tokens (``generated_token_ids``) gives exactly the
tail of the uninterrupted request (greedy with logprobs, seeded sampling with a
repetition penalty and ``min_tokens``, a stop string spanning the seam, a JSON schema),
its text the rest of the text and its logprobs within 1e-5. Then a batch of 24 streams of
those kinds through the ``AsyncClient``: one replica's whole process group is killed with
SIGKILL mid-stream, and every stream completes, equal token for token and text for text
to the same request on the unfaulted replica, no token twice (logprobs within 1e-4: a
batch's composition moves float32 logits by that much).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack

import grpc
import pytest

from tests.e2e.cluster import RunningCluster, serve
from tests.paths import STORIES_DIR, requires_stories
from tpserve.client import AsyncClient, Client
from tpserve.stream_move import MovePolicy, StreamMove
from tpserve.v1 import generate_pb2 as pb
from tpserve.v1 import generate_pb2_grpc

pytestmark = [pytest.mark.e2e, requires_stories]

PROMPT = "Once upon a time, there was a little"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "friends": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                       "maxItems": 3}},
          "required": ["name", "friends"], "additionalProperties": False}
MAX_TOKENS = 300


def _kinds(stop: str) -> dict[str, dict]:
    """Each kind's keyword arguments of ``Client.generate_stream``."""
    return {
        "greedy": dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2),
        "sampled": dict(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1234, repetition_penalty=1.3,
                        presence_penalty=0.3, frequency_penalty=0.2, min_tokens=MAX_TOKENS - 10, logprobs=True),
        "stop": dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stop=[stop]),
        "json": dict(max_tokens=60, temperature=1.0, seed=99, json_schema=SCHEMA, logprobs=True),
    }


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[RunningCluster, RunningCluster]]:
    with ExitStack() as stack:
        doomed = stack.enter_context(serve(STORIES_DIR, 1, new_session=True))
        kept = stack.enter_context(serve(STORIES_DIR, 1, new_session=True))
        yield doomed, kept


def _stream(stub, request: pb.GenerateRequest) -> list[pb.GenerateStreamResponse]:
    return list(stub.GenerateStream(request, timeout=60))


def _tokens(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def _logprobs(messages) -> list[float]:
    return [lp.logprob for m in messages for lp in m.logprobs]


def _stop_string(stub) -> str:
    """Eight characters of the greedy completion, from its 30th token on, whose first occurrence is there:
    they span several tokens, so some continuation below starts inside the held-back match."""
    messages = _stream(stub, _request(_kinds("unused")["greedy"]))
    text = "".join(m.text for m in messages)
    start = len("".join(m.text for m in messages[:30]))
    while text.find(text[start:start + 8]) != start:
        start += 1
    return text[start:start + 8]


def _request(kwargs: dict) -> pb.GenerateRequest:
    from tpserve.client import build_request

    return build_request(PROMPT, **kwargs)


@pytest.fixture(scope="module")
def references(replicas) -> dict[str, list[pb.GenerateStreamResponse]]:
    """Each kind's uninterrupted stream on the replica that is never faulted."""
    stub = generate_pb2_grpc.GenerationStub(replicas[1].client.channel)
    kinds = _kinds(_stop_string(stub))
    return {name: _stream(stub, _request(kwargs)) for name, kwargs in kinds.items()} | {"_kinds": kinds}


@pytest.mark.parametrize("kind", ["greedy", "sampled", "stop", "json"])
def test_a_continuation_from_k_tokens_is_the_tail_of_the_uninterrupted_request(replicas, references, kind) -> None:
    stub = generate_pb2_grpc.GenerationStub(replicas[1].client.channel)
    full = references[kind]
    tokens, text = _tokens(full), "".join(m.text for m in full)
    assert len(tokens) >= 8, tokens
    if kind == "stop":
        assert full[-1].finish_reason == pb.FINISH_REASON_STOP and references["_kinds"]["stop"]["stop"][0] not in text
    # A client holds what whole messages brought: the text delivered with the k-th token. Messages carry
    # one token each, except where the engine merged two that the stream had not yet written (its last
    # steps with async scheduling): a seam inside such a message moves to the message's end.
    delivered: dict[int, str] = {}
    count, text_so_far = 0, ""
    for m in full:
        count, text_so_far = count + len(m.token_ids), text_so_far + m.text
        delivered.setdefault(count, text_so_far)
    ks = sorted({1, len(tokens) // 3, len(tokens) // 2, len(tokens) - 1})
    if kind == "stop":  # every seam from the 25th token on: some fall inside the held-back stop string
        ks = sorted(set(ks) | set(range(25, len(tokens))))
    ks = sorted({min(b for b in delivered if b >= k) for k in ks} - {len(tokens)})
    assert len(ks) >= 3, ks
    for k in ks:
        request = _request(references["_kinds"][kind])
        request.generated_token_ids.extend(tokens[:k])
        rest = _stream(stub, request)
        delivered_text = delivered[k]
        assert _tokens(rest) == tokens[k:], k
        assert delivered_text + "".join(m.text for m in rest) == text, k
        assert rest[-1].finish_reason == full[-1].finish_reason, k
        # The server computed the k given tokens as prompt: usage counts them there (docs/design/cluster.md, "A
        # continuation is checked like output").
        assert (rest[-1].usage.prompt_tokens, rest[-1].usage.completion_tokens) == \
            (full[-1].usage.prompt_tokens + k, full[-1].usage.completion_tokens - k), k
        # The continuation's first k tokens are prefilled (a GEMM over many rows) where the reference decoded
        # them one at a time (the streamed GEMV): another summation order, so float32 logprobs may differ in
        # their last bits (1.05e-5 seen at -9.48), as in the move test below.
        assert _logprobs(rest) == pytest.approx(_logprobs(full)[k:], abs=1e-4), k
    if kind == "json":  # complete and valid under the schema's grammar, whatever the seam
        assert full[-1].finish_reason == pb.FINISH_REASON_STOP and set(json.loads(text)) == {"name", "friends"}


def test_a_continuation_its_format_refuses_is_invalid_argument(replicas, references) -> None:
    # Tokens the JSON grammar cannot have produced are refused, naming the first one the grammar
    # rejects (before continuations were checked: OK, finish STOP, no token: the server vouched for a document
    # it had not produced); a valid cut of the JSON stream passes (the test above), and the replica
    # serves the next request exactly.
    stub = generate_pb2_grpc.GenerationStub(replicas[1].client.channel)
    request = _request(references["_kinds"]["json"])
    request.generated_token_ids.extend(_tokens(references["greedy"])[:5])  # story text, not JSON
    with pytest.raises(grpc.RpcError) as info:
        _stream(stub, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("generated_token_ids[0] (token ")
    assert "breaks sampling_params.response_format.json_schema" in info.value.details()
    assert _tokens(_stream(stub, _request(references["_kinds"]["json"]))) == _tokens(references["json"])


def test_streams_move_off_a_killed_replica_token_for_token(replicas, references) -> None:
    doomed, kept = replicas
    kinds = references["_kinds"]
    names = [name for name in kinds if name != "_kinds"] * 6  # 24 streams, spread over both replicas
    moves: list[StreamMove] = []
    policy = MovePolicy(max_moves=4, initial_backoff_s=0.05, on_move=moves.append)
    target = f"ipv4:{doomed.target},{kept.target}"

    async def main() -> list[list]:
        async with AsyncClient(target, move_policy=policy) as client:
            received: list[list] = [[] for _ in names]

            async def consume(index: int, name: str) -> None:
                async for chunk in client.generate_stream(PROMPT, **kinds[name], timeout_s=60):
                    received[index].append(chunk)

            # round_robin sends only to the addresses it has connected to: a request must reach the
            # doomed replica before the streams start, or on a loaded host they may all go to the other.
            served = await asyncio.to_thread(doomed.metric, "tpserve:prompt_tokens_total")
            deadline = time.monotonic() + 30
            while await asyncio.to_thread(doomed.metric, "tpserve:prompt_tokens_total") == served:
                assert time.monotonic() < deadline, "round_robin never picked the doomed replica"
                await client.generate(PROMPT, max_tokens=1)
            tasks = [asyncio.create_task(consume(i, name)) for i, name in enumerate(names)]
            deadline = time.monotonic() + 30
            # Mid-stream: every stream has delivered tokens, and the doomed replica still holds some.
            while min(len(r) for r in received) < 3 or \
                    await asyncio.to_thread(doomed.metric, "tpserve:num_requests_running") < 2:
                assert time.monotonic() < deadline, [len(r) for r in received]
                await asyncio.sleep(0.005)
            os.killpg(doomed.process.pid, signal.SIGKILL)  # the replica's coordinator and its rank, at once
            await asyncio.gather(*tasks)
            return received

    # The doomed replica compiles the JSON schema's grammar before the streams start (the references
    # ran on the other replica), so that its JSON streams start with the others.
    _stream(generate_pb2_grpc.GenerationStub(doomed.client.channel), _request(kinds["json"]))
    received = asyncio.run(main())
    # The fault hit mid-stream: streams moved with tokens already delivered (how many the doomed
    # replica held depends on round_robin's picks and on which streams had finished).
    assert sum(move.num_delivered_tokens > 0 for move in moves) >= 3, moves
    for name, chunks in zip(names, received, strict=True):
        full = references[name]
        assert [t for c in chunks for t in c.token_ids] == _tokens(full), name  # no token twice, none lost
        assert "".join(c.text for c in chunks) == "".join(m.text for m in full), name
        # 1e-4, not 1e-5: the references ran alone and these in a batch of 24 (then of the moved ones on the
        # other replica); float32 logits on the CPU move by up to 1e-4 with the batch's composition (the
        # seed's documented bound, generate.proto). The continuation itself adds nothing: 1e-5 above.
        assert [lp.logprob for c in chunks for lp in c.logprobs] == pytest.approx(_logprobs(full), abs=1e-4)
        assert chunks[-1].finish_reason is not None and \
            chunks[-1].usage.completion_tokens == full[-1].usage.completion_tokens, name


def test_a_request_with_no_replica_to_move_to_fails_at_once(replicas) -> None:
    doomed, _ = replicas
    assert doomed.process.poll() is not None, "runs after the kill above"
    moves: list[StreamMove] = []
    with Client(doomed.target, move_policy=MovePolicy(on_move=moves.append)) as client:
        for call in (lambda: list(client.generate_stream(PROMPT, max_tokens=4)),
                     lambda: client.generate(PROMPT, max_tokens=4)):
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "connect" in info.value.details().lower()
            assert time.monotonic() - started < 1.0 and not moves
