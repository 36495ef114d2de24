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
with the server's status code and message.

A stream whose replica is lost mid-way (``UNAVAILABLE``, a dropped connection, ``INTERNAL``
from a lost worker group) continues on another address of the target, token for token
(:mod:`tpserve.stream_move`; ``move_policy`` bounds the moves, ``MovePolicy(max_moves=0)``
turns them off). So that it can, a request without a seed gets one from the client.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tpserve.grpc_metadata import metadata_interceptors
from tpserve.results import Timings, Usage, timings_of
from tpserve.sampling_fields import FIELDS, SamplingField
from tpserve.service_config import LoadBalancingPolicy, RetryPolicy, channel_options
from tpserve.stream_move import MovePolicy, StreamMove, StreamMover, with_seed  # noqa: F401 - StreamMove re-exported
from tpserve.v1 import generate_pb2 as pb
from tpserve.v1 import generate_pb2_grpc

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


def describe_rpc_error(exc: grpc.RpcError, target: str, tls: bool = False) -> str:
    """One line for a failed call: the status code, the server's message and, where the cause is likely on
    the caller's side (no server there, TLS on one side only, no API key), what to check."""
    code, details = exc.code(), exc.details() or ""
    line = f"{code.name}: {details}"
    lower = details.lower()
    if code == grpc.StatusCode.UNAVAILABLE:
        if "connection refused" in lower or ("failed to connect" in lower and "ssl" not in lower):
            return (f"{line} -- no tpserve server answers at {target}: start one (tpserve serve) or check "
                    "--target HOST[:PORT]")
        if not tls and ("socket closed" in lower or "connection reset" in lower or "end of file" in lower):
            return (f"{line} -- the server at {target} closed the connection: if it was started with "
                    "--ssl-certfile, connect with TLS (--ssl-ca-certs CA.pem)")
        if tls and ("ssl" in lower or "handshake" in lower or "tls" in lower):
            return (f"{line} -- the TLS handshake with {target} failed: check --ssl-ca-certs (the CA that signed "
                    "the server's certificate), the client certificate if the server requires one, and that the "
                    "server serves TLS at all")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"{line} -- give the server's API key with --api-key or $TPSERVE_API_KEY"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{line} -- the call took longer than its deadline (--timeout)"
    return line

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
            "usage": {"prompt_tokens": self.usage.prompt_tokens, "completion_tokens": self.usage.completion_tokens},
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


def _chunk(response: pb.GenerateStreamResponse) -> StreamChunk:
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


def _deadline(timeout_s: float | None) -> float | None:
    """The monotonic time ``timeout_s`` seconds from now (None: no deadline)."""
    return None if timeout_s is None else time.monotonic() + timeout_s


def _remaining_s(deadline: float | None) -> float | None:
    """Seconds left until a monotonic ``deadline`` (None: no deadline); at least 1 ms, so that an
    attempt past the deadline ends with the server's DEADLINE_EXCEEDED."""
    return None if deadline is None else max(deadline - time.monotonic(), 1e-3)


class GenerateStream:
    """The :class:`StreamChunk` s of a ``GenerateStream`` call, in order. ``cancel()`` cancels the RPC (the
    server frees the request's KV blocks); the call's other methods (``code()``, ``details()``, ...)
    are reachable here too (on the current attempt's call, after a move). Iterating raises
    ``grpc.RpcError`` if the call fails and cannot move to another replica (:mod:`tpserve.stream_move`)."""

    def __init__(self, call, mover: StreamMover | None = None, start=None, deadline: float | None = None) -> None:
        self._call = call
        self._mover = mover
        self._start = start  # (request, timeout_s) -> a new call, for a move
        self._deadline = deadline

    def __iter__(self) -> Iterator[StreamChunk]:
        return self

    def __next__(self) -> StreamChunk:
        while True:
            try:
                message = next(self._call)
            except grpc.RpcError as exc:
                if self._mover is None:
                    raise
                request, backoff_s = self._mover.next_request(exc)  # raises exc when it cannot move
                time.sleep(backoff_s)
                self._call = self._start(request, _remaining_s(self._deadline))
                continue
            return _chunk(self._mover.delivered(message) if self._mover else message)

    def __getattr__(self, name: str):
        return getattr(self._call, name)


class AsyncGenerateStream:
    """:class:`GenerateStream` for :class:`AsyncClient`: ``async for chunk in stream``."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, mover: StreamMover | None = None, start=None,
                 deadline: float | None = None) -> None:
        self._call = call
        self._mover = mover
        self._start = start  # (request, timeout_s) -> a new call, for a move
        self._deadline = deadline

    async def _chunks(self) -> AsyncIterator[StreamChunk]:
        while True:
            try:
                async for response in self._call:
                    yield _chunk(self._mover.delivered(response) if self._mover else response)
                return
            except grpc.RpcError as exc:
                if self._mover is None:
                    raise
                request, backoff_s = self._mover.next_request(exc)  # raises exc when it cannot move
                await asyncio.sleep(backoff_s)
                self._call = self._start(request, _remaining_s(self._deadline))

    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        return self._chunks()

    def __getattr__(self, name: str):
        return getattr(self._call, name)


Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]


def _annotation(spec: SamplingField) -> object:
    """The client keyword's type: an unset scalar is None (the server's default)."""
    if spec.type is list:
        return Sequence[spec.items]
    if spec.type is dict:
        return Mapping[spec.items[0], spec.items[1]] | None
    return bool if spec.type is bool else spec.type | None


def _client_default(spec: SamplingField) -> object:
    return {list: (), dict: None, bool: False}.get(spec.type)


#: build_request's keywords: every field of the sampling table (tpserve/sampling_fields.py), then the rest.
_REQUEST_KEYWORDS = [inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, default=_client_default(spec),
                                       annotation=_annotation(spec)) for spec in FIELDS] + [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
    for name, annotation, default in (
        ("json_schema", str | Mapping | None, None), ("regex", str | None, None),
        ("choices", Sequence[str] | None, None), ("cache_salt", str | None, None), ("priority", int, 0),
        ("request_id", str, ""))]
_PROMPT = inspect.Parameter("prompt", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Prompt)
_KEYWORD_DOCS = "\n".join(f"    {spec.name}: {spec.help}" for spec in FIELDS)


def request_keywords(function):
    """Gives ``function(self?, prompt, *, timeout_s?, **fields)`` the signature of :func:`build_request`'s
    keywords (shown by ``help()`` and ``inspect.signature``) and their meanings in its docstring."""
    signature = inspect.signature(function)
    head = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    tail = [p for p in head if p.kind is inspect.Parameter.KEYWORD_ONLY]  # timeout_s
    head = [p for p in head if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    function.__signature__ = signature.replace(parameters=[*head, *_REQUEST_KEYWORDS, *tail])
    doc = (function.__doc__ or "").rstrip()
    indent = " " * min((len(line) - len(line.lstrip()) for line in doc.splitlines()[1:] if line.strip()), default=4)
    function.__doc__ = f"{doc}\n\n{indent}Sampling keywords (None: the server's default):\n" + \
        "\n".join(indent + line for line in _KEYWORD_DOCS.splitlines()) + "\n"
    return function


@request_keywords
def build_request(prompt: Prompt, **fields) -> pb.GenerateRequest:
    """A GenerateRequest from Python values; None leaves a field unset (the server's default).

    A ``str`` prompt is sent as text, a sequence of ints as token ids, a sequence of
    ``{"role": ..., "content": ...}`` mappings as chat messages (rendered with the
    model's chat template). ``cache_salt`` keeps the request's prefix-cache entries apart
    from those of requests without the same salt. The fields' meanings and ranges:
    proto/tpserve/v1/generate.proto.

    Raises:
        ValueError: more than one of ``json_schema``, ``regex`` and ``choices``.
        TypeError: an unknown keyword.
    """
    bound = build_request.__signature__.bind(prompt, **fields)
    bound.apply_defaults()
    values = bound.arguments
    params = pb.SamplingParams()
    for spec in FIELDS:
        value = values[spec.name]
        try:
            if spec.type is list:
                getattr(params, spec.name).extend(value or ())  # None leaves it unset, as for the others
            elif spec.type is dict:
                getattr(params, spec.name).update(dict(value or {}))
            elif value is not None:
                setattr(params, spec.name, value)
        except (ValueError, TypeError) as exc:  # protobuf's "Value out of range: 10000000000" names no field
            raise ValueError(f"{spec.name}: {exc}") from None
    json_schema, regex, choices = values["json_schema"], values["regex"], values["choices"]
    constraints = [name for name, value in (("json_schema", json_schema), ("regex", regex), ("choices", choices))
                   if value is not None]
    if len(constraints) > 1:
        raise ValueError(f"{' and '.join(constraints)} both constrain the output; give one of json_schema, regex "
                         "and choices")
    if json_schema is not None:  # structured output: at most one of the three
        params.response_format.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    elif regex is not None:
        params.response_format.regex = regex
    elif choices is not None:
        params.response_format.choices.choices.extend(choices)
    request = pb.GenerateRequest(request_id=values["request_id"], sampling_params=params, priority=values["priority"])
    if values["cache_salt"] is not None:
        request.cache_salt = values["cache_salt"]
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], Mapping):
        request.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    else:
        request.token_ids.SetInParent()  # an empty list is still a (bad) token-id prompt
        request.token_ids.ids.extend(prompt)
    return request


@dataclass(frozen=True)
class Credentials:
    """How a client proves itself to a server started with TLS, mutual TLS or API keys.

    Attributes:
        ssl_ca_certs: PEM CA bundle that signed the server's certificate; setting any
            ``ssl_*`` field makes the channel TLS (None here: the system's roots).
        ssl_certfile, ssl_keyfile: PEM client certificate and key (mutual TLS).
        api_key: sent as ``authorization: Bearer <api_key>`` on every Generation call.
    """

    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    api_key: str | None = None

    @property
    def tls(self) -> bool:
        return any((self.ssl_ca_certs, self.ssl_certfile, self.ssl_keyfile))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials from the PEM files.

        Raises:
            OSError: a file cannot be read.
        """
        def read(path: str | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return grpc.ssl_channel_credentials(root_certificates=read(self.ssl_ca_certs),
                                            private_key=read(self.ssl_keyfile),
                                            certificate_chain=read(self.ssl_certfile))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the bearer key, if any."""
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def aio_channel(self, target: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to ``target`` whose every call carries these credentials
        (for stubs used directly, such as the load generator's)."""
        interceptors = metadata_interceptors(self.metadata) if self.metadata else None
        if self.tls:
            return grpc.aio.secure_channel(target, self.channel_credentials(), options=list(options),
                                           interceptors=interceptors)
        return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)

    @staticmethod
    def add_flags(parser) -> None:
        """The client side of ``tpserve serve``'s --ssl-* and --api-key flags, on an argparse parser."""
        group = parser.add_argument_group("credentials")
        group.add_argument("--ssl-ca-certs", help="PEM CA bundle that signed the server's certificate (TLS)")
        group.add_argument("--ssl-certfile", help="PEM client certificate (mutual TLS)")
        group.add_argument("--ssl-keyfile", help="PEM key of --ssl-certfile")
        group.add_argument("--api-key", default=os.environ.get("TPSERVE_API_KEY"),
                           help="bearer key for a server started with --api-key (default: $TPSERVE_API_KEY)")

    @classmethod
    def from_flags(cls, args) -> Credentials:
        """From the attributes :meth:`add_flags` defines on an argparse namespace."""
        return cls(ssl_ca_certs=args.ssl_ca_certs, ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                   api_key=args.api_key)


def _result(response: pb.GenerateResponse) -> GenerateResult:
    return GenerateResult(
        request_id=response.request_id, text=response.text, token_ids=list(response.token_ids),
        finish_reason=FINISH_REASON_NAMES[response.finish_reason],
        usage=Usage(response.usage.prompt_tokens, response.usage.completion_tokens,
                    response.usage.cached_prompt_tokens), logprobs=tuple(response.logprobs),
        prompt_logprobs=tuple(response.prompt_logprobs), timings=timings_of(response))


def _is_serving(response: health_pb2.HealthCheckResponse) -> bool:
    return response.status == health_pb2.HealthCheckResponse.SERVING


class Client:
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

    Raises:
        OSError: a TLS file cannot be read.
    """

    def __init__(self, target: str, *, load_balancing_policy: LoadBalancingPolicy = "round_robin",
                 credentials: Credentials = Credentials(), move_policy: MovePolicy = MovePolicy(),
                 retry_policy: RetryPolicy = RetryPolicy()) -> None:
        self.move_policy = move_policy
        options = channel_options(load_balancing_policy, retry_policy)
        target = with_default_port(target)
        self.channel = (grpc.secure_channel(target, credentials.channel_credentials(), options=options)
                        if credentials.tls else grpc.insecure_channel(target, options=options))
        self._metadata = credentials.metadata
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def wait_ready(self, timeout_s: float = 300.0, poll_s: float = 0.25) -> None:
        """Blocks until the health service reports SERVING (on the address the call lands on).

        Raises:
            TimeoutError: not SERVING after ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if _is_serving(self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)):
                    return
            except grpc.RpcError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not SERVING after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def model_info(self, timeout_s: float | None = 10.0) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s, metadata=self._metadata)

    @request_keywords
    def generate(self, prompt: Prompt, *, timeout_s: float | None = None, **fields) -> GenerateResult:
        """Unary Generate: the whole completion.

        Args:
            prompt: text, token ids, or chat messages (``{"role", "content"}`` mappings).
            fields: the request's keywords (:func:`build_request`, listed below; their meanings and
                ranges: proto/tpserve/v1/generate.proto); None leaves the server's default.
            timeout_s: the call's deadline in seconds (None: no deadline).

        Raises:
            grpc.RpcError: the server's status (INVALID_ARGUMENT naming the field, ...).
            ValueError: more than one of ``json_schema``, ``regex`` and ``choices``.
        """
        request = with_seed(build_request(prompt, **fields))
        mover, deadline = StreamMover(request, self.move_policy, self._metadata), _deadline(timeout_s)
        while True:  # a lost replica's request is sent again, whole: the same seed, the same completion
            try:
                return _result(self.stub.Generate(request, timeout=_remaining_s(deadline), metadata=mover.metadata))
            except grpc.RpcError as exc:
                request, backoff_s = mover.next_request(exc)  # raises exc when it cannot move
                time.sleep(backoff_s)

    @request_keywords
    def generate_stream(self, prompt: Prompt, *, timeout_s: float | None = None, **fields) -> GenerateStream:
        """Server-streaming GenerateStream: :class:`StreamChunk` s as the tokens come; ``cancel()`` cancels
        the RPC. Takes :meth:`generate`'s arguments.

        Args:
            prompt: text, token ids, or chat messages (``{"role", "content"}`` mappings).
            fields: the request's keywords (:func:`build_request`, listed below; their meanings and
                ranges: proto/tpserve/v1/generate.proto); None leaves the server's default.
            timeout_s: the call's deadline in seconds (None: no deadline).

        Raises:
            grpc.RpcError: the server's status (INVALID_ARGUMENT naming the field, ...).
            ValueError: more than one of ``json_schema``, ``regex`` and ``choices``.
        """
        request = with_seed(build_request(prompt, **fields))
        mover, deadline = StreamMover(request, self.move_policy, self._metadata), _deadline(timeout_s)

        def start(req: pb.GenerateRequest, timeout: float | None):  # a moved stream: the same traceparent
            return self.stub.GenerateStream(req, timeout=timeout, metadata=mover.metadata)

        return GenerateStream(start(request, timeout_s), mover, start, deadline)

    def abort(self, *request_ids: str, timeout_s: float | None = 10.0) -> int:
        """Ends the caller's requests with these ids now, wherever they are (at most 4096 ids a call);
        returns how many samples were in flight."""
        return self.stub.Abort(pb.AbortRequest(request_ids=request_ids), timeout=timeout_s,
                               metadata=self._metadata).num_aborted


class AsyncClient:
    """asyncio client with :class:`Client`'s methods, as coroutines; streams are ``async for`` iterables.

    Create it inside a running event loop (``async with AsyncClient(target) as client``).
    """

    def __init__(self, target: str, *, load_balancing_policy: LoadBalancingPolicy = "round_robin",
                 credentials: Credentials = Credentials(), move_policy: MovePolicy = MovePolicy(),
                 retry_policy: RetryPolicy = RetryPolicy()) -> None:
        self.move_policy = move_policy
        options = channel_options(load_balancing_policy, retry_policy)
        target = with_default_port(target)
        self.channel = (grpc.aio.secure_channel(target, credentials.channel_credentials(), options=options)
                        if credentials.tls else grpc.aio.insecure_channel(target, options=options))
        self._metadata = credentials.metadata
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def wait_ready(self, timeout_s: float = 300.0, poll_s: float = 0.25) -> None:
        """Waits until the health service reports SERVING.

        Raises:
            TimeoutError: not SERVING after ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if _is_serving(await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)):
                    return
            except grpc.aio.AioRpcError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not SERVING after {timeout_s:.0f} s")
            await asyncio.sleep(poll_s)

    async def model_info(self, timeout_s: float | None = 10.0) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s, metadata=self._metadata)

    @request_keywords
    async def generate(self, prompt: Prompt, *, timeout_s: float | None = None, **fields) -> GenerateResult:
        """Unary Generate: the whole completion.

        Args:
            prompt: text, token ids, or chat messages (``{"role", "content"}`` mappings).
            fields: the request's keywords (:func:`build_request`, listed below; their meanings and
                ranges: proto/tpserve/v1/generate.proto); None leaves the server's default.
            timeout_s: the call's deadline in seconds (None: no deadline).

        Raises:
            grpc.RpcError: the server's status (INVALID_ARGUMENT naming the field, ...).
            ValueError: more than one of ``json_schema``, ``regex`` and ``choices``.
        """
        request = with_seed(build_request(prompt, **fields))
        mover, deadline = StreamMover(request, self.move_policy, self._metadata), _deadline(timeout_s)
        while True:  # a lost replica's request is sent again, whole: the same seed, the same completion
            try:
                return _result(await self.stub.Generate(request, timeout=_remaining_s(deadline), metadata=mover.metadata))
            except grpc.RpcError as exc:
                request, backoff_s = mover.next_request(exc)  # raises exc when it cannot move
                await asyncio.sleep(backoff_s)

    @request_keywords
    def generate_stream(self, prompt: Prompt, *, timeout_s: float | None = None, **fields) -> AsyncGenerateStream:
        """Server-streaming GenerateStream: ``async for chunk in ...`` gives :class:`StreamChunk` s;
        ``cancel()`` cancels the RPC (so does cancelling the task that iterates it), and the server frees
        the request's KV blocks. Takes :meth:`generate`'s arguments.

        Args:
            prompt: text, token ids, or chat messages (``{"role", "content"}`` mappings).
            fields: the request's keywords (:func:`build_request`, listed below; their meanings and
                ranges: proto/tpserve/v1/generate.proto); None leaves the server's default.
            timeout_s: the call's deadline in seconds (None: no deadline).

        Raises:
            grpc.RpcError: the server's status (INVALID_ARGUMENT naming the field, ...).
            ValueError: more than one of ``json_schema``, ``regex`` and ``choices``.
        """
        request = with_seed(build_request(prompt, **fields))
        mover, deadline = StreamMover(request, self.move_policy, self._metadata), _deadline(timeout_s)

        def start(req: pb.GenerateRequest, timeout: float | None):  # a moved stream: the same traceparent
            return self.stub.GenerateStream(req, timeout=timeout, metadata=mover.metadata)

        return AsyncGenerateStream(start(request, timeout_s), mover, start, deadline)
