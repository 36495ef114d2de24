"""``Client`` and ``AsyncClient`` are one client that awaits or not (tpserve/client_calls.py): the same
RPC methods with the same signatures, and the same plan run by both drivers, without a server.

Against a real server: tests/e2e/test_client_abort.py (abort on both), tests/test_grpc_retry_policy.py,
tests/cluster/test_stream_move.py.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tpserve.client import AsyncClient, Client, Credentials, build_request
from tpserve.client_calls import Calls, run_async, run_blocking
from tpserve.stream_move import MovePolicy
from tpserve.v1 import generate_pb2 as pb

#: Every RPC of the Generation service, plus the health wait and close.
RPC_METHODS = {"wait_ready", "model_info", "generate", "generate_stream", "abort", "close", "load_lora_adapter",
               "unload_lora_adapter", "list_lora_adapters"}


def _public_methods(cls: type) -> dict[str, object]:
    return {name: member for name, member in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def test_both_clients_have_every_rpc_with_the_same_signature() -> None:
    sync, asynchronous = _public_methods(Client), _public_methods(AsyncClient)
    assert set(sync) == set(asynchronous) == RPC_METHODS
    for name in RPC_METHODS:
        ours, theirs = inspect.signature(sync[name]), inspect.signature(asynchronous[name])
        assert list(ours.parameters.values()) == list(theirs.parameters.values()), name
        # The stream's iterator is the only type that differs: for vs async for.
        assert ours.return_annotation == theirs.return_annotation.replace("AsyncGenerateStream", "GenerateStream")
        assert sync[name].__doc__ == asynchronous[name].__doc__, name
    assert inspect.signature(Client.__init__) == inspect.signature(AsyncClient.__init__)
    # generate and generate_stream take build_request's prompt and keywords, then timeout_s.
    fields = list(inspect.signature(build_request).parameters)
    for method in (Client.generate, Client.generate_stream):
        assert list(inspect.signature(method).parameters) == ["self", *fields, "timeout_s"]


def test_the_asyncio_client_awaits_every_rpc_but_the_stream() -> None:
    asynchronous = _public_methods(AsyncClient)
    assert {name for name, method in asynchronous.items() if inspect.iscoroutinefunction(method)} == \
        RPC_METHODS - {"generate_stream"}
    assert not any(inspect.iscoroutinefunction(method) for method in _public_methods(Client).values())
    assert inspect.signature(AsyncClient.generate_stream).return_annotation == "AsyncGenerateStream"


class RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeStub:
    """A Generation (and Health) stub whose methods answer from ``answers`` in turn (an exception is
    raised) and record each call; ``asynchronous`` makes them coroutines, as a grpc.aio stub's calls."""

    def __init__(self, answers: list[object], asynchronous: bool) -> None:
        self.answers, self.calls = list(answers), []
        for name in ("Generate", "GetModelInfo", "Abort", "Check", "LoadLoRAAdapter", "UnloadLoRAAdapter",
                     "ListLoRAAdapters"):
            setattr(self, name, self._method(name, asynchronous))

    def _method(self, name: str, asynchronous: bool):
        def answer(request, timeout=None, metadata=None):
            self.calls.append((name, request, timeout, metadata))
            value = self.answers.pop(0)
            if isinstance(value, BaseException):
                raise value
            return value

        async def answer_async(request, timeout=None, metadata=None):
            await asyncio.sleep(0)
            return answer(request, timeout, metadata)

        return answer_async if asynchronous else answer


def _run_both(make_plan, answers: list[object]) -> list[tuple[object, list]]:
    """``make_plan(calls)``'s outcome (value or exception) and the stub's calls, blocking then asyncio."""
    outcomes = []
    for asynchronous in (False, True):
        stub = FakeStub(answers, asynchronous)
        calls = Calls(stub, stub, Credentials(api_key="k").metadata, MovePolicy(initial_backoff_s=0.01), TARGET)
        plan = make_plan(calls)
        try:
            value = asyncio.run(run_async(plan)) if asynchronous else run_blocking(plan)
        except (grpc.RpcError, TimeoutError) as exc:
            value = exc
        outcomes.append((value, stub.calls))
    return outcomes


TARGET = "127.0.0.1:50051"
DROPPED = RpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed")
DONE = pb.GenerateResponse(request_id="r-1", text=" done", token_ids=[4, 5], finish_reason=pb.FINISH_REASON_LENGTH,
                           usage=pb.Usage(prompt_tokens=3, completion_tokens=2))


def test_a_lost_replicas_generate_is_sent_again_whole_by_both_drivers() -> None:
    for result, calls in _run_both(lambda c: c.generate("Once", 30.0, {"max_tokens": 2}), [DROPPED, DONE]):
        assert (result.text, result.token_ids, result.finish_reason) == (" done", [4, 5], "length")
        assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, 2)
        (_, first, first_timeout, metadata), (_, second, second_timeout, _) = calls
        assert first == second and first.sampling_params.HasField("seed")  # the same seed: the same completion
        assert 29.0 < second_timeout < first_timeout <= 30.0  # one deadline for both attempts
        assert ("authorization", "Bearer k") in metadata


def test_an_error_that_cannot_move_reaches_the_caller_from_both_drivers() -> None:
    refused = RpcError(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be at least 1")
    for error, calls in _run_both(lambda c: c.generate("Once", None, {"max_tokens": 0}), [refused, DONE]):
        assert error is refused and len(calls) == 1 and calls[0][2] is None


def test_wait_ready_polls_until_serving_on_both_drivers() -> None:
    status = health_pb2.HealthCheckResponse
    answers = [RpcError(grpc.StatusCode.UNAVAILABLE, "connection refused"), status(status=status.NOT_SERVING),
               status(status=status.SERVING)]
    for value, calls in _run_both(lambda c: c.wait_ready(5.0, 0.001), answers):
        assert value is None and [name for name, *_ in calls] == ["Check"] * 3
        assert {timeout for _, _, timeout, _ in calls} == {2.0}
    for error, calls in _run_both(lambda c: c.wait_ready(0.0, 0.001), [status(status=status.NOT_SERVING)] * 2):
        assert isinstance(error, TimeoutError) and len(calls) == 1


def test_wait_ready_waits_no_longer_than_its_timeout_and_says_why_it_gave_up_on_both_drivers() -> None:
    """Each poll had a 2 s deadline whatever the timeout (wait_ready(0.5) took 2 s), the message said "after 0 s",
    and the calls' errors were dropped: "connection refused" or a TLS mismatch read as "not SERVING"."""
    refused = RpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: "
                       "ipv4:127.0.0.1:50051: Failed to connect to remote host: Connection refused")
    for error, calls in _run_both(lambda c: c.wait_ready(0.05, 0.01), [refused] * 100):
        assert isinstance(error, TimeoutError) and error.__cause__ is refused
        assert str(error).startswith("server not SERVING after 0.05 s; the last health check: UNAVAILABLE: ")
        assert f"no tpserve server answers at {TARGET}" in str(error)
        assert all(timeout <= 0.05 for _, _, timeout, _ in calls)
    status = health_pb2.HealthCheckResponse
    for error, _ in _run_both(lambda c: c.wait_ready(0.0, 0.001), [status(status=status.NOT_SERVING)]):
        assert str(error) == "server not SERVING after 0 s; the last health check: it reports NOT_SERVING"


def test_wait_ready_on_a_listener_that_never_answers_ends_at_its_timeout() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        with Client(target) as client:
            started = time.monotonic()
            with pytest.raises(TimeoutError) as error:
                client.wait_ready(timeout_s=0.5)
            elapsed_s = time.monotonic() - started
    assert 0.5 <= elapsed_s < 1.5
    assert str(error.value).startswith("server not SERVING after 0.5 s; the last health check: DEADLINE_EXCEEDED: ")
    assert f"nothing at {target} answered the health check" in str(error.value)


@pytest.mark.parametrize("ids", [("a",), ("a", "b", "c")])
def test_abort_and_model_info_send_the_same_request_from_both_drivers(ids: tuple[str, ...]) -> None:
    answers = [pb.AbortResponse(num_aborted=len(ids))]
    for num_aborted, calls in _run_both(lambda c: c.abort(ids, 10.0), answers):
        assert num_aborted == len(ids)
        assert calls == [("Abort", pb.AbortRequest(request_ids=ids), 10.0, (("authorization", "Bearer k"),))]
    for info, calls in _run_both(lambda c: c.model_info(10.0), [pb.ModelInfo(model_name="m", max_model_len=64)]):
        assert (info.model_name, info.max_model_len) == ("m", 64) and calls[0][0] == "GetModelInfo"


def _abort_on_replicas(answers: list[object]) -> list[tuple[object, list[list]]]:
    """``Calls.abort(["r"], 10.0, replicas)`` over one fake replica per answer, blocking then asyncio: the
    outcome (the count or the exception) and each replica's calls."""
    outcomes = []
    for asynchronous in (False, True):
        main = FakeStub([], asynchronous)  # the round-robin channel: never used when the replicas are known
        replicas = [FakeStub([answer], asynchronous) for answer in answers]
        calls = Calls(main, main, Credentials(api_key="k").metadata, MovePolicy())
        plan = calls.abort(["r"], 10.0, replicas)
        try:
            value = asyncio.run(run_async(plan)) if asynchronous else run_blocking(plan)
        except grpc.RpcError as exc:
            value = exc
        assert main.calls == []
        outcomes.append((value, [replica.calls for replica in replicas]))
    return outcomes


def test_abort_reaches_every_replica_and_sums_their_counts_on_both_drivers() -> None:
    # The request runs on the second replica: round-robin would have sent the abort to the first one alone.
    for num_aborted, calls in _abort_on_replicas([pb.AbortResponse(num_aborted=0), pb.AbortResponse(num_aborted=2),
                                                  pb.AbortResponse(num_aborted=1)]):
        assert num_aborted == 3
        assert calls == [[("Abort", pb.AbortRequest(request_ids=["r"]), 10.0, (("authorization", "Bearer k"),))]] * 3


def test_abort_leaves_out_an_unavailable_replica_but_not_a_refusal() -> None:
    down = RpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
    for num_aborted, _ in _abort_on_replicas([down, pb.AbortResponse(num_aborted=1)]):
        assert num_aborted == 1
    for error, _ in _abort_on_replicas([down, down]):  # no replica answered: the caller must know
        assert error is down
    too_many = RpcError(grpc.StatusCode.INVALID_ARGUMENT, "request_ids: at most 4096")
    late = RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    for answers, refusal in (([pb.AbortResponse(num_aborted=1), too_many], too_many),
                             ([late, pb.AbortResponse(num_aborted=1), down], late)):
        for error, calls in _abort_on_replicas(answers):
            assert error is refusal and all(len(replica) == 1 for replica in calls)


def test_lora_adapter_calls_send_the_same_requests_from_both_drivers() -> None:
    key = (("authorization", "Bearer k"),)
    for slot, calls in _run_both(lambda c: c.load_lora_adapter("a", "/adapters/a", 60.0),
                                 [pb.LoadLoRAAdapterResponse(slot=3)]):
        assert slot == 3
        assert calls == [("LoadLoRAAdapter", pb.LoadLoRAAdapterRequest(name="a", path="/adapters/a"), 60.0, key)]
    full = RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "every one of the --max-loras 1 adapter slots is taken")
    for error, calls in _run_both(lambda c: c.load_lora_adapter("b", "/b", None), [full, pb.LoadLoRAAdapterResponse()]):
        assert error is full and len(calls) == 1  # a load is not retried
    for value, calls in _run_both(lambda c: c.unload_lora_adapter("a", 10.0), [pb.UnloadLoRAAdapterResponse()]):
        assert value is None and calls == [("UnloadLoRAAdapter", pb.UnloadLoRAAdapterRequest(name="a"), 10.0, key)]
    listed = pb.ListLoRAAdaptersResponse(adapters=[pb.LoRAAdapter(name="a", path="/a", slot=1)], max_loras=2)
    for value, calls in _run_both(lambda c: c.list_lora_adapters(10.0), [listed]):
        assert value == listed and calls[0][0] == "ListLoRAAdapters"


def test_an_async_client_made_outside_an_event_loop_says_so_at_once() -> None:
    """grpc.aio binds a channel to the loop it is made on: one made outside failed only at its first call, with
    grpc's "Task ... got Future ... attached to a different loop"."""
    import pytest

    from tpserve.client import AsyncClient

    with pytest.raises(RuntimeError, match="AsyncClient must be created inside a running event loop"):
        AsyncClient("127.0.0.1:1")


@pytest.mark.parametrize("prompt, fields, message", [
    ("Once", {"priority": "1"}, "priority must be an int, got str"),
    ("Once", {"request_id": 7}, "request_id must be a str, got int"),
    ("Once", {"cache_salt": 1.5}, "cache_salt must be a str, got float"),
    ("Once", {"priority": 2**40}, "priority: Value out of range"),
    ([{"role": "user"}], {}, 'prompt[0]: a chat message is a mapping with "role" and "content"'),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], {}, "prompt[1].content must be a str, got int"),
    ([1, -(2**40)], {}, "prompt: token ids must be int32 values"),
    (7, {}, "prompt must be text, token ids or chat messages, got int"),
])
def test_an_argument_the_request_cannot_hold_is_a_value_error_naming_it_on_both_clients(prompt, fields, message) -> None:
    """priority="1" was a bare TypeError naming no field, a message without "content" a KeyError."""
    with Client("127.0.0.1:1") as client, pytest.raises(ValueError) as sync_error:
        client.generate(prompt, **fields)

    async def asynchronous() -> None:
        async with AsyncClient("127.0.0.1:1") as client:
            await client.generate(prompt, **fields)

    with pytest.raises(ValueError) as async_error:
        asyncio.run(asynchronous())
    assert str(sync_error.value) == str(async_error.value) and str(sync_error.value).startswith(message)


def test_a_call_on_a_closed_client_is_the_same_value_error_on_both_clients() -> None:
    """grpc's own: ValueError "Cannot invoke RPC on closed channel!" from the blocking client,
    grpc.aio.UsageError "Channel is closed." from the asyncio one."""
    client = Client("127.0.0.1:1")
    client.close()
    for call in (lambda: client.generate("Once"), lambda: client.generate_stream("Once"), lambda: client.abort("r"),
                 lambda: client.model_info(), lambda: client.wait_ready(1)):
        with pytest.raises(ValueError, match=r"^the client of 127\.0\.0\.1:1 is closed$"):
            call()

    async def asynchronous() -> None:
        async with AsyncClient("127.0.0.1:1") as client:
            pass
        with pytest.raises(ValueError, match=r"^the client of 127\.0\.0\.1:1 is closed$"):
            await client.generate("Once")
        with pytest.raises(ValueError, match=r"^the client of 127\.0\.0\.1:1 is closed$"):
            client.generate_stream("Once")
        with pytest.raises(ValueError, match=r"^the client of 127\.0\.0\.1:1 is closed$"):
            await client.abort("r")

    asyncio.run(asynchronous())


def test_a_boolean_field_takes_only_a_bool() -> None:
    """protobuf's bool takes any int: vLLM's ``logprobs=5`` (its top 5) was sent as True, and no top logprobs came."""
    import pytest

    with pytest.raises(ValueError, match="logprobs must be True or False, got 5; top_logprobs=N asks for the N"):
        build_request("Hi", logprobs=5)
    with pytest.raises(ValueError, match="ignore_eos must be True or False, got 1"):
        build_request("Hi", ignore_eos=1)
    assert build_request("Hi", logprobs=True, top_logprobs=5).sampling_params.top_logprobs == 5
    assert build_request("Hi </s>", parse_special_tokens=True).parse_special_tokens
