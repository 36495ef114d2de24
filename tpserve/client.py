"""Clients of the tpserve Generation API: blocking (:class:`Client`) and asyncio (:class:`AsyncClient`).

    from tpserve.client import Client
    with Client("127.0.0.1:50051") as client:
        client.wait_ready(timeout_s=60)
        result = client.generate("Once upon a time", max_tokens=32, temperature=0)
        print(result.text, result.finish_reason, result.usage)

    from tpserve.client import AsyncClient
    async with AsyncClient("dns:///tpserve-replicas.default.svc:50051") as client:
        async for chunk in client.generate_stream("The dog", max_tokens=32):
            print(chunk.text, end="")

A target is anything gRPC resolves: ``host:port``, ``dns:///name:port`` (every
address the name has), ``ipv4:10.0.0.1:50051,10.0.0.2:50051`` or ``unix:///path``.
Requests are spread over all the target's addresses, one request at a time, by
gRPC's own ``round_robin`` policy: gRPC keeps one HTTP/2 connection per address,
so without it every request of a client would go to the first replica
(``pick_first``). Errors surface as ``grpc.RpcError`` (``grpc.aio.AioRpcError``)
with the server's status code and message; an argument the request cannot hold is a
``ValueError`` naming it before any call (``TypeError`` for an unknown keyword), and so is
a call on a closed client, from both clients.

A stream whose replica is lost mid-way (``UNAVAILABLE``, a dropped connection, ``INTERNAL``
from a lost worker group) continues on another address of the target, token for token
(:mod:`tpserve.stream_move`; ``move_policy`` bounds the moves, ``MovePolicy(max_moves=0)``
turns them off). So that it can, a request without a seed gets one from the client.
A replica that goes silent without closing its connections (a frozen process, a host or link
gone) is noticed by HTTP/2 keepalive pings: its calls fail with ``UNAVAILABLE`` within about
20 s of its last frame and move the same way (``keepalive``; tpserve/service_config.py).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2_grpc

from tpserve.client_calls import Calls, run_async, run_blocking
from tpserve.client_streams import AsyncGenerateStream, GenerateStream
from tpserve.credentials import Credentials
from tpserve.replica_targets import ReplicaStubs, replica_addresses
from tpserve.request_builder import Prompt, build_request, request_keywords
from tpserve.results import FINISH_REASON_NAMES, GenerateResult, StreamChunk, Timings, Usage, chunk_of
from tpserve.rpc_errors import describe_rpc_error
from tpserve.service_config import Keepalive, LoadBalancingPolicy, RetryPolicy, channel_options
from tpserve.stream_move import MovePolicy, StreamMove
from tpserve.v1 import generate_pb2 as pb
from tpserve.v1 import generate_pb2_grpc

# What callers import from here, wherever it is defined.
__all__ = ["DEFAULT_PORT", "FINISH_REASON_NAMES", "AsyncClient", "AsyncGenerateStream", "Client", "Credentials",
           "GenerateResult", "GenerateStream", "Keepalive", "MovePolicy", "Prompt", "RetryPolicy", "StreamChunk", "StreamMove",
           "Timings", "Usage", "build_request", "check_target", "describe_rpc_error", "request_keywords", "with_default_port"]

_chunk = chunk_of  # the name tests/test_client_chunks.py and older callers know

DEFAULT_PORT = 50051  # tpserve serve's --port


def with_default_port(target: str) -> str:
    """``target`` with tpserve's port where it names a host alone: ``127.0.0.1`` -> ``127.0.0.1:50051``,
    ``::1`` or ``[::1]`` -> ``[::1]:50051`` (gRPC itself would dial 443). Targets with a port or a
    resolver scheme (``dns:///``, ``ipv4:``, ``unix:``) are returned unchanged."""
    if "/" in target or target.startswith(("ipv4:", "ipv6:", "unix:", "dns:", "vsock:", "unix-abstract:")):
        return target
    if target.startswith("["):
        return target if "]:" in target else f"{target}:{DEFAULT_PORT}"
    if target.count(":") > 1:  # a bare IPv6 address
        return f"[{target}]:{DEFAULT_PORT}"
    return target if ":" in target else f"{target}:{DEFAULT_PORT}"


#: Schemes of targets gRPC parses itself (an address list, a socket path): checked by gRPC, not here.
_GRPC_ADDRESS_SCHEMES = ("ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")


def check_target(target: str) -> None:
    """Refuses a ``HOST:PORT`` target (bare, or after ``dns:``) that gRPC cannot dial, before any call: a port
    that is not a number in 1-65535 (gRPC fails each call with UNAVAILABLE "errors resolving", as if no server
    answered, or dials port 443 for ``host:``, or 99999 mod 65536), no host, or a URL. Address lists, socket
    paths and other resolvers' targets are left to gRPC.

    Raises:
        ValueError: what is wrong with the target.
    """
    if target.startswith(("http://", "https://", "grpc://", "grpcs://")):
        raise ValueError(f"{target} is a URL; give HOST:PORT (a gRPC target has no http:// or grpc:// scheme)")
    if target.startswith(_GRPC_ADDRESS_SCHEMES) or ("/" in target and not target.startswith("dns:")):
        return
    host_port = target.removeprefix("dns:")
    host_port = host_port[2:].partition("/")[2] if host_port.startswith("//") else host_port  # dns://server/name
    if host_port.startswith("["):
        host, closed, rest = host_port[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ValueError(f"{target}: an IPv6 address goes in brackets before the port: [ADDRESS]:PORT")
        port = rest[1:] if rest else None
    elif host_port.count(":") > 1:
        return  # a bare IPv6 address (after dns:): gRPC's to parse
    else:
        host, colon, port_text = host_port.partition(":")
        port = port_text if colon else None
    if not host.strip() or host != host.strip():
        raise ValueError(f"{target}: no host name before the port: give HOST:PORT")
    if port is not None and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"{target}: the port {port!r} is not a number in 1-65535")


F = TypeVar("F", bound=Callable[..., Any])


def _doc_of(plan: Callable[..., Any]) -> Callable[[F], F]:
    """Gives a client method its plan's docstring (tpserve/client_calls.py), written once for both clients."""
    def give(method: F) -> F:
        method.__doc__ = plan.__doc__
        return method
    return give


class _ClientBase:
    """The channel, stubs and :class:`Calls` of a client; ``channel`` is blocking or asyncio."""

    def __init__(self, channel: Any, target: str, credentials: Credentials, move_policy: MovePolicy,
                 asynchronous: bool) -> None:
        self.channel = channel
        self.target = target
        self._replicas = ReplicaStubs(credentials, asynchronous)  # abort's way to every replica
        self._metadata = credentials.metadata
        self.stub = generate_pb2_grpc.GenerationStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        self._channel_calls = Calls(self.stub, self.health, self._metadata, move_policy, target, credentials.tls)
        self._closed = False
        self._streams: weakref.WeakSet[GenerateStream | AsyncGenerateStream] = weakref.WeakSet()  # abort's, moving

    def _abort_moving(self, request_ids: Sequence[str]) -> int:
        """Ends this client's streams of ``request_ids`` that are between two attempts of a move: an abort reaches
        no replica of theirs then, and the continuation started after it ran to its end. Returns how many."""
        ids = frozenset(request_ids)
        return sum(stream.abort_if_moving(ids) for stream in list(self._streams))

    @property
    def _calls(self) -> Calls:
        """The calls on the client's channel.

        Raises:
            ValueError: the client is closed; the same error from both clients, as a closed file's (grpc's own
                differ: ValueError from a blocking channel, ``grpc.aio.UsageError`` from an asyncio one).
        """
        if self._closed:
            raise ValueError(f"the client of {self.target} is closed")
        return self._channel_calls

    @property
    def move_policy(self) -> MovePolicy:
        """How streams (and unary calls) broken by a lost replica move to another address; settable."""
        return self._channel_calls.move_policy

    @move_policy.setter
    def move_policy(self, policy: MovePolicy) -> None:
        self._channel_calls.move_policy = policy


class Client(_ClientBase):
    """Blocking client of the tpserve servers at ``target`` (see the module docstring).

    Args:
        target: ``host:port``, ``dns:///name:port``, ``ipv4:a:p,b:p``, ...; a host alone means port 50051.
        load_balancing_policy: ``round_robin`` spreads requests over every address of
            the target; ``pick_first`` sends them all to one.
        credentials: TLS files and API key for a server that requires them.
        move_policy: how streams broken by a lost replica move to another address
            (:class:`tpserve.stream_move.MovePolicy`; ``MovePolicy(max_moves=0)``: never).
        retry_policy: gRPC's own retries of UNAVAILABLE and RESOURCE_EXHAUSTED, with server pushback
            (:class:`tpserve.service_config.RetryPolicy`; ``RetryPolicy(max_attempts=1)``: none).
        keepalive: HTTP/2 pings that notice a replica gone silent (frozen, cut off): a ping after 10 s
            without a frame from it, and its calls fail with ``UNAVAILABLE`` (then move) when the ping
            goes unanswered for 10 s more (:class:`tpserve.service_config.Keepalive`).

    After :meth:`close` (the ``with`` block's end) every call raises ValueError, as a closed file's methods do.

    Raises:
        OSError: a TLS file cannot be read.
        ValueError: a ``target`` gRPC cannot dial (:func:`check_target`: a port that is not a number in
            1-65535, ...), ``load_balancing_policy`` neither ``round_robin`` nor ``pick_first``, or ``keepalive``
            out of range (``keepalive.time_s`` below 1 s); a ``RetryPolicy`` out of gRPC's range is refused when
            it is made.
    """

    def __init__(self, target: str, *, load_balancing_policy: LoadBalancingPolicy = "round_robin",
                 credentials: Credentials = Credentials(), move_policy: MovePolicy = MovePolicy(),
                 retry_policy: RetryPolicy = RetryPolicy(), keepalive: Keepalive = Keepalive()) -> None:
        options = channel_options(load_balancing_policy, retry_policy, keepalive)
        target = with_default_port(target)
        check_target(target)
        super().__init__(grpc.secure_channel(target, credentials.channel_credentials(), options=options)
                         if credentials.tls else grpc.insecure_channel(target, options=options),
                         target, credentials, move_policy, asynchronous=False)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel (and abort's, one per replica); calls in flight end with CANCELLED, and calls
        made after it raise ValueError."""
        self._closed = True
        self._replicas.close()
        self.channel.close()

    @_doc_of(Calls.wait_ready)
    def wait_ready(self, timeout_s: float = 300.0, poll_s: float = 0.25) -> None:
        run_blocking(self._calls.wait_ready(timeout_s, poll_s))

    @_doc_of(Calls.model_info)
    def model_info(self, timeout_s: float | None = 10.0) -> pb.ModelInfo:
        return run_blocking(self._calls.model_info(timeout_s))

    @request_keywords
    @_doc_of(Calls.generate)
    def generate(self, prompt: Prompt, *, timeout_s: float | None = None, **fields: Any) -> GenerateResult:
        return run_blocking(self._calls.generate(prompt, timeout_s, fields))

    @request_keywords
    @_doc_of(Calls.stream)
    def generate_stream(self, prompt: Prompt, *, timeout_s: float | None = None, **fields: Any) -> GenerateStream:
        start = self._calls.stream(prompt, timeout_s, fields)
        stream = GenerateStream(start.call, start.mover, start.start, start.deadline)
        self._streams.add(stream)
        return stream

    @_doc_of(Calls.abort)
    def abort(self, *request_ids: str, timeout_s: float | None = 10.0) -> int:
        calls = self._calls  # a closed client opens no channel to the replicas
        addresses = replica_addresses(self.target)
        replicas = self._replicas.stubs(addresses) if addresses is not None else []
        return self._abort_moving(request_ids) + run_blocking(calls.abort(request_ids, timeout_s, replicas))

    @_doc_of(Calls.load_lora_adapter)
    def load_lora_adapter(self, name: str, path: str, *, timeout_s: float | None = 60.0) -> int:
        return run_blocking(self._calls.load_lora_adapter(name, path, timeout_s))

    @_doc_of(Calls.unload_lora_adapter)
    def unload_lora_adapter(self, name: str, *, timeout_s: float | None = 10.0) -> None:
        run_blocking(self._calls.unload_lora_adapter(name, timeout_s))

    @_doc_of(Calls.list_lora_adapters)
    def list_lora_adapters(self, *, timeout_s: float | None = 10.0) -> pb.ListLoRAAdaptersResponse:
        return run_blocking(self._calls.list_lora_adapters(timeout_s))


class AsyncClient(_ClientBase):
    """asyncio client with :class:`Client`'s arguments and methods, as coroutines; streams are ``async for``
    iterables (``generate_stream`` itself is not awaited).

    Create it inside a running event loop (``async with AsyncClient(target) as client``).

    Raises:
        RuntimeError: no event loop is running (grpc.aio binds the channel to the loop it is made on; one made
            outside failed only at its first call, with grpc's "attached to a different loop").
    """

    def __init__(self, target: str, *, load_balancing_policy: LoadBalancingPolicy = "round_robin",
                 credentials: Credentials = Credentials(), move_policy: MovePolicy = MovePolicy(),
                 retry_policy: RetryPolicy = RetryPolicy(), keepalive: Keepalive = Keepalive()) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("AsyncClient must be created inside a running event loop (in a coroutine: "
                               "async with AsyncClient(target) as client); use Client outside one") from None
        options = channel_options(load_balancing_policy, retry_policy, keepalive)
        target = with_default_port(target)
        check_target(target)
        super().__init__(grpc.aio.secure_channel(target, credentials.channel_credentials(), options=options)
                         if credentials.tls else grpc.aio.insecure_channel(target, options=options),
                         target, credentials, move_policy, asynchronous=True)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channel (and abort's, one per replica); calls in flight end with CANCELLED, and calls
        made after it raise ValueError."""
        self._closed = True
        for closing in self._replicas.close():
            await closing
        await self.channel.close()

    @_doc_of(Calls.wait_ready)
    async def wait_ready(self, timeout_s: float = 300.0, poll_s: float = 0.25) -> None:
        await run_async(self._calls.wait_ready(timeout_s, poll_s))

    @_doc_of(Calls.model_info)
    async def model_info(self, timeout_s: float | None = 10.0) -> pb.ModelInfo:
        return await run_async(self._calls.model_info(timeout_s))

    @request_keywords
    @_doc_of(Calls.generate)
    async def generate(self, prompt: Prompt, *, timeout_s: float | None = None, **fields: Any) -> GenerateResult:
        return await run_async(self._calls.generate(prompt, timeout_s, fields))

    @request_keywords
    @_doc_of(Calls.stream)
    def generate_stream(self, prompt: Prompt, *, timeout_s: float | None = None,
                        **fields: Any) -> AsyncGenerateStream:
        start = self._calls.stream(prompt, timeout_s, fields)
        stream = AsyncGenerateStream(start.call, start.mover, start.start, start.deadline)
        self._streams.add(stream)
        return stream

    @_doc_of(Calls.abort)
    async def abort(self, *request_ids: str, timeout_s: float | None = 10.0) -> int:
        calls = self._calls  # a closed client opens no channel to the replicas
        # A host name's look-up blocks: off the event loop. The channels are made on the loop (grpc.aio's rule).
        addresses = await asyncio.to_thread(replica_addresses, self.target)
        replicas = self._replicas.stubs(addresses) if addresses is not None else []
        return self._abort_moving(request_ids) + await run_async(calls.abort(request_ids, timeout_s, replicas))

    @_doc_of(Calls.load_lora_adapter)
    async def load_lora_adapter(self, name: str, path: str, *, timeout_s: float | None = 60.0) -> int:
        return await run_async(self._calls.load_lora_adapter(name, path, timeout_s))

    @_doc_of(Calls.unload_lora_adapter)
    async def unload_lora_adapter(self, name: str, *, timeout_s: float | None = 10.0) -> None:
        await run_async(self._calls.unload_lora_adapter(name, timeout_s))

    @_doc_of(Calls.list_lora_adapters)
    async def list_lora_adapters(self, *, timeout_s: float | None = 10.0) -> pb.ListLoRAAdaptersResponse:
        return await run_async(self._calls.list_lora_adapters(timeout_s))
