"""The step path between the coordinator and the ranks of its own host: a Unix socket, not gRPC.

Every step costs a plan written to every rank and the sampling rank's answer read back. Over a
gRPC stream each message also wakes the rank's gRPC threads, and the completion thread of
grpcio's server takes the GIL in the middle of the step's compute: measured on the embedded
model at 16 sequences, the same plans execute in 1.03-1.07 ms on a gRPC stream against
0.91-0.97 on a plain socket and 0.91-0.95 back to back in-process (benchmarks/README.md,
step_overhead). vLLM's engine core likewise sends scheduler outputs to its workers through
shared memory and sockets, not RPC. Ranks on other hosts keep the ``Step`` gRPC stream.

The socket is the rank's gRPC Unix socket path plus ``.step``; the rank serves one connection
at a time on the thread that runs its steps. Frames are a 4-byte little-endian length and a
serialized protobuf message: first the coordinator's hello, then ``StepPlan`` messages one way
and ``StepResult`` messages the other, exactly as on the ``Step`` stream (an ``errors-only``
connection is answered only for a failed step, tpserve/step_pb.py ``ERRORS_ONLY``).

The hello is ``tpserve-step/1 <answer-all|errors-only> <cluster secret or ->``: the socket
file is the rank's own (mode 0600, in the group's private directory), and with
``--cluster-secret-file`` the secret is checked as gRPC's interceptor checks it.

No torch; no grpc: the coordinator imports this too.
"""

from __future__ import annotations

import hmac
import struct

PROTOCOL = "tpserve-step/1"
ANSWER_ALL, ERRORS_ONLY_MODE = "answer-all", "errors-only"
#: The largest frame either side accepts, bytes (the gRPC channels' message limit).
MAX_FRAME_BYTES = 64 * 1024**2
_LENGTH = struct.Struct("<I")


def socket_path(grpc_address: str) -> str | None:
    """The step socket of a rank whose gRPC address is ``unix:///path``: ``/path.step``; None for a
    rank reached over TCP (another host), whose steps keep the gRPC stream."""
    if not grpc_address.startswith("unix:"):
        return None
    path = grpc_address.removeprefix("unix:")
    if path.startswith("//"):
        path = path[2:]
    return path + ".step"


def frame(payload: bytes) -> bytes:
    """``payload`` with its length in front.

    Raises:
        ValueError: a payload over MAX_FRAME_BYTES.
    """
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"a {len(payload)}-byte step message exceeds the {MAX_FRAME_BYTES}-byte limit")
    return _LENGTH.pack(len(payload)) + payload


def frame_length(header: bytes) -> int:
    """The payload length a 4-byte header announces.

    Raises:
        ValueError: a length over MAX_FRAME_BYTES (a peer that does not speak this protocol).
    """
    (length,) = _LENGTH.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"a step frame announces {length} bytes, over the {MAX_FRAME_BYTES}-byte limit")
    return length


def hello(errors_only: bool, secret: str | None) -> bytes:
    """The coordinator's first frame's payload."""
    return f"{PROTOCOL} {ERRORS_ONLY_MODE if errors_only else ANSWER_ALL} {secret or '-'}".encode()


def parse_hello(payload: bytes, secret: str | None) -> bool:
    """Whether the connection answers every plan (True) or only failed steps (False).

    Raises:
        PermissionError: not this protocol, or not the group's secret.
    """
    try:
        protocol, mode, given = payload.decode().split(" ")
    except ValueError:
        raise PermissionError("not a tpserve step connection") from None
    if protocol != PROTOCOL or mode not in (ANSWER_ALL, ERRORS_ONLY_MODE):
        raise PermissionError(f"not a {PROTOCOL} connection: {protocol} {mode}")
    if secret is not None and not hmac.compare_digest(given.encode(), secret.encode()):
        raise PermissionError("the step connection does not carry the cluster secret")
    return mode == ANSWER_ALL
