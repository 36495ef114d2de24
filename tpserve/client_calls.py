"""Every RPC of the tpserve clients, built once: :class:`Client` and :class:`AsyncClient`
(tpserve/client.py) differ only in whether they await.

A unary call is a *plan*: a generator that builds the request, the call metadata, the deadline and the
stream mover, then yields what it needs done (:class:`Invoke` a stub method, :class:`Sleep` a backoff)
and is sent the response, or has the call's ``grpc.RpcError`` thrown into it. :func:`run_blocking` does
each step with a blocking channel and ``time.sleep``; :func:`run_async` awaits it on an asyncio
channel and ``asyncio.sleep``. A plan therefore holds every rule of its RPC (which errors move a
request to another replica, how long it waits, which deadline the next attempt gets) and the two
clients cannot drift apart.

A stream is started the same way (:meth:`Calls.stream`), then read by the blocking or the asyncio
iterator (tpserve/client_streams.py), which share the move-on-error step.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2

from tpserve.request_builder import Prompt, build_request
from tpserve.results import GenerateResult, result_of
from tpserve.rpc_errors import describe_rpc_error
from tpserve.stream_move import MovePolicy, StreamMover, with_seed
from tpserve.v1 import generate_pb2 as pb

T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]
#: The longest a wait_ready poll waits for the health service's answer, seconds (less when less of the wait is left).
HEALTH_POLL_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class Invoke:
    """A step of a plan: call ``method(request, timeout=timeout, metadata=metadata)`` (a stub's method;
    ``timeout`` in seconds, None: no deadline) and send the plan its response."""

    method: Callable[..., Any]
    request: Any
    timeout: float | None
    metadata: Metadata | None = None


@dataclass(frozen=True, slots=True)
class InvokeAll:
    """A step of a plan: make every call of ``invokes`` at once and send the plan the list of their
    responses, in order, each a response or the call's ``grpc.RpcError`` (never thrown into the plan)."""

    invokes: tuple[Invoke, ...]


@dataclass(frozen=True, slots=True)
class Sleep:
    """A step of a plan: wait ``seconds`` (a backoff, a poll interval)."""

    seconds: float


Plan = Generator[Invoke | InvokeAll | Sleep, Any, T]


def deadline_of(timeout_s: float | None) -> float | None:
    """The monotonic time ``timeout_s`` seconds from now (None: no deadline)."""
    return None if timeout_s is None else time.monotonic() + timeout_s


def remaining_s(deadline: float | None) -> float | None:
    """Seconds left until a monotonic ``deadline`` (None: no deadline); at least 1 ms, so that an
    attempt past the deadline ends with the server's DEADLINE_EXCEEDED."""
    return None if deadline is None else max(deadline - time.monotonic(), 1e-3)


def run_blocking(plan: Plan[T]) -> T:
    """Runs ``plan`` on a blocking channel: its value, or the exception it lets out (a call's
    ``grpc.RpcError`` it does not handle, ``TimeoutError``, ...)."""
    sent: Any = None
    error: grpc.RpcError | None = None
    try:
        while True:
            try:
                step = plan.send(sent) if error is None else plan.throw(error)
            except StopIteration as done:
                return done.value
            sent, error = None, None
            if isinstance(step, Sleep):
                time.sleep(step.seconds)
                continue
            if isinstance(step, InvokeAll):
                # One thread a call: a replica that does not answer costs its deadline once, not once per replica.
                with ThreadPoolExecutor(max_workers=len(step.invokes)) as pool:
                    sent = list(pool.map(_call_blocking, step.invokes))
                continue
            try:
                sent = step.method(step.request, timeout=step.timeout, metadata=step.metadata)
            except grpc.RpcError as exc:  # the plan decides: move, retry, or let it out
                error = exc
    finally:
        plan.close()


async def run_async(plan: Plan[T]) -> T:
    """:func:`run_blocking` on an asyncio channel: each call and each sleep awaited. Cancelling the
    awaiting task cancels the call in flight and ends the plan."""
    sent: Any = None
    error: grpc.RpcError | None = None
    try:
        while True:
            try:
                step = plan.send(sent) if error is None else plan.throw(error)
            except StopIteration as done:
                return done.value
            sent, error = None, None
            if isinstance(step, Sleep):
                await asyncio.sleep(step.seconds)
                continue
            if isinstance(step, InvokeAll):
                sent = list(await asyncio.gather(*map(_call_async, step.invokes)))
                continue
            try:
                sent = await step.method(step.request, timeout=step.timeout, metadata=step.metadata)
            except grpc.RpcError as exc:  # grpc.aio.AioRpcError is one
                error = exc
    finally:
        plan.close()


def _call_blocking(step: Invoke) -> Any:
    """``step``'s response, or its ``grpc.RpcError`` returned (an :class:`InvokeAll` call)."""
    try:
        return step.method(step.request, timeout=step.timeout, metadata=step.metadata)
    except grpc.RpcError as exc:
        return exc


async def _call_async(step: Invoke) -> Any:
    """:func:`_call_blocking`, awaited."""
    try:
        return await step.method(step.request, timeout=step.timeout, metadata=step.metadata)
    except grpc.RpcError as exc:
        return exc


@dataclass(frozen=True, slots=True)
class StreamStart:
    """What a stream iterator needs: the first attempt's call, the mover (None: no moves), how to start
    another attempt (``start(request, timeout_s)``) and the monotonic deadline of them all."""

    call: Any
    mover: StreamMover | None
    start: Callable[[pb.GenerateRequest, float | None], Any]
    deadline: float | None


class Calls:
    """Every Generation and health RPC of one channel's stubs, built once for both clients.

    Args:
        stub: a ``GenerationStub`` on a blocking or an asyncio channel.
        health: a ``HealthStub`` on the same channel.
        metadata: sent with every Generation call (the API key's bearer header, or nothing).
        move_policy: how a request broken by a lost replica moves to another address.
        target, tls: the channel's target and whether it is TLS, for what ``wait_ready`` says when it gives up.
    """

    def __init__(self, stub: Any, health: Any, metadata: Metadata, move_policy: MovePolicy, target: str = "",
                 tls: bool = False) -> None:
        self.stub = stub
        self.health = health
        self.metadata = metadata
        self.move_policy = move_policy
        self.target = target
        self.tls = tls

    def wait_ready(self, timeout_s: float, poll_s: float) -> Plan[None]:
        """Until the health service reports SERVING (on the address the call lands on), polling every
        ``poll_s`` seconds; a poll waits at most 2 s for its answer, and never past ``timeout_s``.

        Raises:
            TimeoutError: not SERVING after ``timeout_s`` seconds. The message says what the last poll got (the
                status the server reported, or the call's error and what to check: no server at the target,
                TLS on one side only, ...); the call's ``grpc.RpcError`` is its ``__cause__``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            poll_timeout_s = min(HEALTH_POLL_TIMEOUT_S, deadline - time.monotonic())
            error: grpc.RpcError | None = None
            try:
                response = yield Invoke(self.health.Check, health_pb2.HealthCheckRequest(service=""),
                                        max(poll_timeout_s, 1e-3))
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                got = f"it reports {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}"
            except grpc.RpcError as exc:  # not listening yet, or never will: said if it stays so
                error, got = exc, self._poll_error(exc, poll_timeout_s)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"server not SERVING after {timeout_s:g} s; the last health check: {got}") \
                    from error
            yield Sleep(max(min(poll_s, deadline - time.monotonic()), 0.0))

    def _poll_error(self, exc: grpc.RpcError, poll_timeout_s: float) -> str:
        """A failed health check in words: its deadline is the poll's, not the caller's --timeout."""
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return (f"DEADLINE_EXCEEDED: no answer within {max(poll_timeout_s, 1e-3):.2g} s -- nothing at {self.target} "
                    "answered the health check: check --target HOST[:PORT]")
        return describe_rpc_error(exc, self.target, self.tls)

    def model_info(self, timeout_s: float | None) -> Plan[pb.ModelInfo]:
        """The served model's ``ModelInfo`` (name, context length, ...)."""
        return (yield Invoke(self.stub.GetModelInfo, pb.GetModelInfoRequest(), timeout_s, self.metadata))

    def generate(self, prompt: Prompt, timeout_s: float | None, fields: Mapping[str, Any]) -> Plan[GenerateResult]:
        """Unary Generate: the whole completion. A request whose replica is lost is sent again, whole, to
        another (the same seed: the same completion), while ``move_policy`` allows and the deadline lasts.

        Args:
            prompt: text, token ids, or chat messages (``{"role", "content"}`` mappings).
            fields: the request's keywords (:func:`build_request`, listed below; their meanings and
                ranges: proto/tpserve/v1/generate.proto); None leaves the server's default.
            timeout_s: the call's deadline in seconds (None: no deadline).

        Raises:
            grpc.RpcError: the server's status (INVALID_ARGUMENT naming the field, ...).
            ValueError: a keyword or the prompt the request cannot hold (a wrong type, out of range, a chat
                message without "content"), naming it; more than one of ``json_schema``, ``regex`` and
                ``choices``; the client is closed.
            TypeError: an unknown keyword.
        """
        request = with_seed(build_request(prompt, **fields))
        mover, deadline = StreamMover(request, self.move_policy, self.metadata), deadline_of(timeout_s)
        while True:
            try:
                return result_of((yield Invoke(self.stub.Generate, request, remaining_s(deadline), mover.metadata)))
            except grpc.RpcError as exc:
                request, backoff_s = mover.next_request(exc)  # raises exc when it cannot move
                yield Sleep(backoff_s)

    def stream(self, prompt: Prompt, timeout_s: float | None, fields: Mapping[str, Any]) -> StreamStart:
        """Server-streaming GenerateStream: :class:`StreamChunk` s as the tokens come (``for`` over a
        :class:`Client`'s stream, ``async for`` over an :class:`AsyncClient`'s; not a plan, and not awaited:
        the stream is read message by message). ``cancel()`` cancels the RPC (so does cancelling the task
        that iterates an asyncio stream), and the server frees the request's KV blocks. A stream whose
        replica is lost continues on another, token for token (:mod:`tpserve.stream_move`). Takes
        ``generate``'s arguments.

        Args:
            prompt: text, token ids, or chat messages (``{"role", "content"}`` mappings).
            fields: the request's keywords (:func:`build_request`, listed below; their meanings and
                ranges: proto/tpserve/v1/generate.proto); None leaves the server's default.
            timeout_s: the call's deadline in seconds (None: no deadline).

        Raises:
            grpc.RpcError: (iterating) the server's status (INVALID_ARGUMENT naming the field, ...).
            ValueError: as ``generate``'s (a keyword or the prompt the request cannot hold, naming it, ...).
            TypeError: an unknown keyword.
        """
        request = with_seed(build_request(prompt, **fields))
        mover, deadline = StreamMover(request, self.move_policy, self.metadata), deadline_of(timeout_s)

        def start(req: pb.GenerateRequest, timeout: float | None) -> Any:  # a moved stream: the same traceparent
            return self.stub.GenerateStream(req, timeout=timeout, metadata=mover.metadata)

        return StreamStart(start(request, timeout_s), mover, start, deadline)

    def abort(self, request_ids: Sequence[str], timeout_s: float | None, replicas: Sequence[Any] = ()) -> Plan[int]:
        """Abort: ends the caller's requests with these ids now, on every replica of the target (at most
        4096 ids a call); the number of samples that were in flight, summed over the replicas (0: none of
        the ids is running). The call goes to every address the target resolves to at once, each with
        ``timeout_s`` (seconds; None: no deadline): round-robin would send it to one replica, rarely the
        one running the request (tpserve/replica_targets.py). A stream of this client between two attempts
        of a move (no replica runs it then) ends with CANCELLED instead of continuing, and counts too.

        Raises:
            grpc.RpcError: a replica refused the call for a reason the others share (INVALID_ARGUMENT: more
                than 4096 ids; UNAUTHENTICATED; DEADLINE_EXCEEDED: a replica did not answer in time, so it
                may still run the request), or no replica answered (UNAVAILABLE). A replica that is
                UNAVAILABLE (down, loading, draining) while another answered is left out: no stream of
                this client runs there.
        """
        request = pb.AbortRequest(request_ids=request_ids)
        if len(replicas) <= 1:  # one address: the client's own channel reaches it
            return (yield Invoke(self.stub.Abort, request, timeout_s, self.metadata)).num_aborted
        answers = yield InvokeAll(tuple(Invoke(stub.Abort, request, timeout_s, self.metadata) for stub in replicas))
        errors = [answer for answer in answers if isinstance(answer, grpc.RpcError)]
        refused = [error for error in errors if error.code() != grpc.StatusCode.UNAVAILABLE]
        if refused or len(errors) == len(answers):
            raise (refused or errors)[0]
        return sum(answer.num_aborted for answer in answers if not isinstance(answer, grpc.RpcError))

    def load_lora_adapter(self, name: str, path: str, timeout_s: float | None) -> Plan[int]:
        """LoadLoRAAdapter (operator-only with API key roles): serve the PEFT adapter directory ``path``
        (read by the server's ranks) as ``name``; the worker slot it took. Not retried: a load is not idempotent.

        Raises:
            grpc.RpcError: RESOURCE_EXHAUSTED (no free slot), INVALID_ARGUMENT (a bad adapter, naming the
                tensor or field), ALREADY_EXISTS, PERMISSION_DENIED, FAILED_PRECONDITION (LoRA off).
        """
        request = pb.LoadLoRAAdapterRequest(name=name, path=path)
        return (yield Invoke(self.stub.LoadLoRAAdapter, request, timeout_s, self.metadata)).slot

    def unload_lora_adapter(self, name: str, timeout_s: float | None) -> Plan[None]:
        """UnloadLoRAAdapter (operator-only with API key roles): stop serving ``name``.

        Raises:
            grpc.RpcError: NOT_FOUND, FAILED_PRECONDITION (requests naming it in flight), PERMISSION_DENIED.
        """
        yield Invoke(self.stub.UnloadLoRAAdapter, pb.UnloadLoRAAdapterRequest(name=name), timeout_s, self.metadata)

    def list_lora_adapters(self, timeout_s: float | None) -> Plan[pb.ListLoRAAdaptersResponse]:
        """ListLoRAAdapters (operator-only with API key roles): the adapters served, by slot, and ``max_loras``."""
        return (yield Invoke(self.stub.ListLoRAAdapters, pb.ListLoRAAdaptersRequest(), timeout_s, self.metadata))
