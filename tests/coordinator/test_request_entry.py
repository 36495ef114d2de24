"""RequestEntry.unless_aborted: the awaited work's result or error, RequestAborted on an abort, and no
exception left for asyncio to log as never retrieved when the work fails as the handler is cancelled (a
client's deadline passing as validation or a grammar build ends)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from coordinator.errors import InvalidArgumentError
from coordinator.request_table import RequestAborted, RequestEntry


async def _fails() -> None:
    raise InvalidArgumentError("prompt is 600 tokens; it must be shorter than max_model_len=512")


def _run_reporting_unhandled(main) -> list[dict]:
    """Runs ``main()`` on a fresh loop; returns what reached the loop's exception handler (after a collection,
    which is when asyncio reports a task whose exception nobody read)."""
    reported: list[dict] = []

    async def wrapper() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
        await main()
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(wrapper())
    return reported


def test_the_work_s_error_and_result_come_through() -> None:
    async def main() -> None:
        entry = RequestEntry("r1", "")
        with pytest.raises(InvalidArgumentError, match="600 tokens"):
            await entry.unless_aborted(_fails())
        assert await entry.unless_aborted(asyncio.sleep(0, result=7)) == 7

    assert _run_reporting_unhandled(main) == []


def test_an_abort_gives_up_the_wait() -> None:
    async def main() -> None:
        entry = RequestEntry("r1", "")
        waiting = asyncio.ensure_future(entry.unless_aborted(asyncio.sleep(30)))
        await asyncio.sleep(0)
        entry.abort()
        with pytest.raises(RequestAborted):
            await waiting

    assert _run_reporting_unhandled(main) == []


def test_work_failing_as_the_handler_is_cancelled_leaves_nothing_unretrieved() -> None:
    async def main() -> None:
        entry = RequestEntry("r1", "")
        handler = asyncio.ensure_future(entry.unless_aborted(_fails()))
        await asyncio.sleep(0)  # the handler starts the work and waits on it
        await asyncio.sleep(0)  # the work fails; the handler's wake-up is only scheduled
        handler.cancel()  # and the deadline cancels the handler before it resumes, as gRPC does
        with pytest.raises(asyncio.CancelledError):
            await handler

    reported = _run_reporting_unhandled(main)
    assert reported == [], [c.get("message") for c in reported]
