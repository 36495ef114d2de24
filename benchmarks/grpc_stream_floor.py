"""The floor under benchmarks/coordinator_cpu.py: what one streamed gRPC message costs a bare ``grpc.aio`` server.

A server process with no engine at all: each ``GenerateStream`` call waits for a shared
"step" (a future completed every ``--step-ms`` milliseconds, as the engine loop wakes every
stream once per step) and then yields one ``GenerateStreamResponse`` of the size a decode
step sends (request id, a short text delta, one token id). The client process opens
``--streams`` concurrent streams of ``--messages`` messages on one channel. The server's
own CPU time (``/proc/<pid>/stat``, user and system apart) divided by the messages sent is
the cost of a message that no per-token work of ours can remove. If it is above the per-token goal's
40 µs per output token, that goal needs fewer messages than tokens.

    .venv/bin/python benchmarks/grpc_stream_floor.py --streams 64 256
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.cluster import free_port  # noqa: E402
from tpserve.v1 import generate_pb2 as pb  # noqa: E402
from tpserve.v1 import generate_pb2_grpc  # noqa: E402

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def user_system_seconds(pid: int) -> tuple[float, float]:
    """(utime, stime) of process ``pid`` in seconds (fields 14 and 15 of proc(5))."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / _TICKS_PER_S, int(fields[12]) / _TICKS_PER_S


class _Steps:
    """A future completed every ``step_s`` seconds: every stream wakes once per step."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.next: asyncio.Future | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.next = loop.create_future()
            await asyncio.sleep(self.step_s)
            self.next.set_result(None)


class _Servicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, steps: _Steps) -> None:
        self.steps = steps

    async def GenerateStream(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        for index in range(request.sampling_params.max_tokens):
            await self.steps.next
            yield pb.GenerateStreamResponse(request_id="req-0123456789ab", text=" the", token_ids=[300 + index % 500])


def _serve(port: int, step_s: float) -> None:
    async def main() -> None:
        steps = _Steps(step_s)
        server = grpc.aio.server()
        generate_pb2_grpc.add_GenerationServicer_to_server(_Servicer(steps), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        stepper = asyncio.ensure_future(steps.run())  # noqa: F841 - runs until the process ends
        await server.wait_for_termination()

    asyncio.run(main())


async def _drive(target: str, num_streams: int, num_messages: int) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(max_tokens=num_messages))

        async def stream() -> int:
            return sum([1 async for _ in stub.GenerateStream(request, wait_for_ready=True)])

        return sum(await asyncio.gather(*(stream() for _ in range(num_streams))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--messages", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=3.0)
    args = parser.parse_args()
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(port, args.step_ms / 1e3), daemon=True)
    server.start()
    target = f"127.0.0.1:{port}"
    try:
        asyncio.run(_drive(target, 4, 8))  # warm-up (waits for the server to listen)
        for num_streams in args.streams:
            user0, sys0 = user_system_seconds(server.pid)
            num = asyncio.run(_drive(target, num_streams, args.messages))
            user1, sys1 = user_system_seconds(server.pid)
            print(f"streams={num_streams} messages={num}: server CPU per message "
                  f"{(user1 - user0 + sys1 - sys0) / num * 1e6:.1f} us "
                  f"(user {(user1 - user0) / num * 1e6:.1f}, system {(sys1 - sys0) / num * 1e6:.1f})", flush=True)
    finally:
        server.terminate()
        server.join(10)


if __name__ == "__main__":
    main()
