"""One request's outputs on their way from the engine loop to its gRPC handler.

The engine loop puts one ``RequestOutput`` per step; the handler takes them and writes
each as a stream message. A gRPC message costs the coordinator far more than a token
does (about 45-55 µs of CPU per message for a bare ``grpc.aio`` server on a 2-core
host, most of it the C core's ``sendmsg``; benchmarks/coordinator_cpu.py), so when the
handler falls behind (a busy event loop, a slow reader), the outputs that piled up are
merged into one: one message carries every token, text delta and logprob since the
previous one, exactly as a multi-token (speculative) step's output does. A handler that
keeps up still gets one output per step, so latency does not change. (vLLM's
``RequestOutputCollector`` does the same between its engine core and API server.)

Cheaper than ``asyncio.Queue``: no deque, no getter list, one future per wait, created
only when the handler would otherwise block. Single event loop, no locks. No torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.engine import RequestOutput


class RequestOutputCollector:
    """Holds what the engine produced for one request that its handler has not taken yet.

    At most one output (the merge of everything pending) and at most one error are held;
    the output is handed over before the error, so no text produced before a failure is lost.
    """

    __slots__ = ("_output", "_error", "_waiter")

    def __init__(self) -> None:
        self._output: RequestOutput | None = None
        self._error: Exception | None = None
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: RequestOutput | Exception) -> None:
        """Adds a step's output (merged into any pending one) or an error (the first one is kept)."""
        if isinstance(item, Exception):
            if self._error is None:
                self._error = item
        elif self._output is None:
            self._output = item
        else:
            self._output = merge_outputs(self._output, item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput:
        """The pending output (the merge of every step's since the last ``get``), waiting for one.

        Raises:
            Exception: the error put (after any output put before it was taken).
        """
        while self._output is None and self._error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        output = self._output
        if output is None:
            raise self._error
        self._output = None
        return output


def merge_outputs(first: RequestOutput, second: RequestOutput) -> RequestOutput:
    """One output equal to ``first`` then ``second`` of the same request: deltas and tokens joined,
    finish and usage from ``second`` (the later), prompt logprobs from whichever has them (the first output)."""
    return dataclasses.replace(
        second, text=first.text + second.text, token_ids=first.token_ids + second.token_ids,
        logprobs=first.logprobs + second.logprobs, prompt_logprobs=first.prompt_logprobs or second.prompt_logprobs)
