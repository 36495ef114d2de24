"""A small synchronous client for the tpserve Generation API.

    from tpserve.client import Client
    with Client("127.0.0.1:50051") as client:
        client.wait_ready(timeout_s=60)
        result = client.generate("Once upon a time", max_tokens=32, temperature=0)
        print(result.text, result.finish_reason, result.usage)

Errors surface as ``grpc.RpcError`` with the server's status code and message.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tpserve.v1 import generate_pb2 as pb
from tpserve.v1 import generate_pb2_grpc

FINISH_REASON_NAMES = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A finished completion: text, token ids, "stop" | "length" | "abort", usage in tokens."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage

    def to_json_dict(self) -> dict:
        """The ``tpserve generate --json`` object."""
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": {"prompt_tokens": self.usage.prompt_tokens, "completion_tokens": self.usage.completion_tokens},
        }


def build_request(
    prompt: str | Sequence[int],
    *,
    request_id: str = "",
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
) -> pb.GenerateRequest:
    """A GenerateRequest from Python values; None leaves a field unset (the server's default).

    A ``str`` prompt is sent as text, a sequence of ints as token ids.
    """
    params = pb.SamplingParams(stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_k", top_k),
                        ("top_p", top_p), ("seed", seed)):
        if value is not None:
            setattr(params, name, value)
    request = pb.GenerateRequest(request_id=request_id, sampling_params=params)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.SetInParent()  # an empty list is still a (bad) token-id prompt
        request.token_ids.ids.extend(prompt)
    return request


class Client:
    """Blocking client of one tpserve server at ``target`` ("host:port")."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def wait_ready(self, timeout_s: float = 300.0, poll_s: float = 0.25) -> None:
        """Blocks until the health service reports SERVING.

        Raises:
            TimeoutError: not SERVING after ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                response = self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not SERVING after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def model_info(self, timeout_s: float | None = 10.0) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s)

    def generate(self, prompt: str | Sequence[int], timeout_s: float | None = None, **sampling) -> GenerateResult:
        """Unary Generate; ``sampling`` takes the keyword arguments of :func:`build_request`."""
        response = self.stub.Generate(build_request(prompt, **sampling), timeout=timeout_s)
        return GenerateResult(
            request_id=response.request_id, text=response.text, token_ids=list(response.token_ids),
            finish_reason=FINISH_REASON_NAMES[response.finish_reason],
            usage=Usage(response.usage.prompt_tokens, response.usage.completion_tokens))

    def generate_stream(self, prompt: str | Sequence[int], timeout_s: float | None = None,
                        **sampling) -> Iterator[pb.GenerateStreamResponse]:
        """Server-streaming GenerateStream; the iterator's ``cancel()`` cancels the RPC."""
        return self.stub.GenerateStream(build_request(prompt, **sampling), timeout=timeout_s)
