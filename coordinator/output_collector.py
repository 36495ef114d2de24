"""One request's outputs on their way from the engine loop to its gRPC handler.

The engine loop puts one ``RequestOutput`` per step; the handler takes them and writes
each as a stream message. A gRPC message costs the coordinator far more than a token
does (about 35-50 µs of CPU per message for a bare ``grpc.aio`` server on a 2-core
host, most of it the C core's ``sendmsg``; benchmarks/grpc_stream_floor.py), so the
outputs that piled up when the handler takes them are merged into one: one message
carries every token, text delta and logprob since the previous one, exactly as a
multi-token (speculative) step's output does. (vLLM's ``RequestOutputCollector`` does
the same between its engine core and API server.)

Two things pile outputs up:

- a handler that falls behind (a busy event loop, a slow reader): it still gets every
  token, in fewer messages; one that keeps up gets one output per step, so latency does
  not change;
- ``stream_interval`` (vLLM's and SGLang's ``--stream-interval``): the handler is woken only
  once ``stream_interval`` tokens are pending, or the request finished or failed; the first
  output goes out at once (time to first token unchanged). 1, the default, wakes it every
  step; larger values trade smoothness for fewer messages, hence less coordinator CPU per
  token. A unary ``Generate`` waits for the end anyway and uses no interval at all
  (:data:`UNARY`): one wake-up per request.

Cheaper than ``asyncio.Queue``: no deque, no getter list, one future per wait, created
only when the handler would otherwise block, on the loop looked up at the first wait
(``asyncio.get_running_loop`` makes a ``getpid`` system call each time). Single event
loop, no locks. No torch.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.request_output import RequestOutput

#: The interval of a handler that only wants the request's last output (unary Generate).
UNARY = sys.maxsize


class RequestOutputCollector:
    """Holds what the engine produced for one request that its handler has not taken yet.

    Args:
        stream_interval: pending tokens that wake the handler (>= 1); a finished output, an
            error, and the request's first output wake it whatever the count.

    At most one error is held (the first); pending outputs are handed over, merged, before
    it, so no text produced before a failure is lost.
    """

    __slots__ = ("_pending", "_num_tokens", "_error", "_waiter", "_interval", "_started", "_ready", "_loop")

    def __init__(self, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        self._pending: list[RequestOutput] = []
        self._num_tokens = 0  # tokens in _pending
        self._error: Exception | None = None
        self._waiter: asyncio.Future | None = None
        self._interval = stream_interval
        self._started = False  # an output was handed over (the first is never held back)
        self._ready = False  # _pending is due to the handler
        self._loop: asyncio.AbstractEventLoop | None = None  # the handler's, from its first wait on

    def put_nowait(self, item: RequestOutput | Exception) -> None:
        """Adds a step's output (merged with any pending ones when taken) or an error (the first one is kept)."""
        if isinstance(item, Exception):
            if self._error is None:
                self._error = item
        else:
            self._pending.append(item)
            self._num_tokens += len(item.token_ids)
            if self._num_tokens >= self._interval or item.finish_reason is not None or not self._started:
                self._ready = True
            if not self._ready:
                return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput:
        """The pending outputs merged into one, waiting until they are due (see the module's docstring).

        Raises:
            Exception: the error put (after any output put before it was taken).
        """
        while not self._ready and self._error is None:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pending = self._pending
        if not pending:
            assert self._error is not None  # the wait above ends on an output or on an error
            raise self._error
        self._pending, self._num_tokens, self._started, self._ready = [], 0, True, False
        return pending[0] if len(pending) == 1 else merge_outputs(pending)


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """One output equal to ``outputs`` in order, all of one request: deltas, tokens and logprobs
    joined, finish and usage from the last, prompt logprobs from whichever has them (the first
    output of a request)."""
    last = outputs[-1]
    return type(last)(
        last.request_id, "".join(out.text for out in outputs), [t for out in outputs for t in out.token_ids],
        last.finish_reason, last.num_prompt_tokens, last.num_completion_tokens, last.num_cached_prompt_tokens,
        tuple(lp for out in outputs for lp in out.logprobs),
        next((out.prompt_logprobs for out in outputs if out.prompt_logprobs), ()))
