"""Validation lanes (coordinator/validation_lanes.py): a request waits only behind requests of its own kind.

The fault: every request was validated on ``asyncio.to_thread``'s one pool, so a caller's long prompts (or slow
schemas) filled its threads and another caller's one-line request queued behind them for seconds (12 x 1 MiB
prompts held a 1-token request 10.9 s at tp 1, 28 s at tp 2). Here the long and grammar lanes are filled with
work that cannot finish until the test lets it, and a short request must still complete.
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from coordinator import validation_lanes
from coordinator.validation_lanes import LONG_PROMPT_BYTES, lane, run_in_lane
from tpserve.client import build_request
from tpserve.v1 import generate_pb2 as pb

SHORT = build_request("Hi", max_tokens=1)
LONG = build_request("a " * (LONG_PROMPT_BYTES // 2 + 1), max_tokens=1)
SCHEMA = build_request("Hi", json_schema={"type": "integer"})


def test_each_request_kind_has_its_lane() -> None:
    assert LONG.ByteSize() > LONG_PROMPT_BYTES
    assert (lane(SHORT), lane(LONG), lane(SCHEMA)) == ("default", "long_prompt", "grammar")
    long_chat = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="b" * 70_000)]))
    assert lane(long_chat) == "long_prompt"  # a chat's size counts as a text's
    assert lane(build_request([1, 2, 3], regex="[a-z]+")) == "grammar"


def test_a_short_request_does_not_wait_behind_long_prompts_or_grammars() -> None:
    release = threading.Event()
    # Far more blocked requests than any pool has threads (asyncio.to_thread's: min(32, cpus + 4)).
    num_blocked = 2 * min(32, (os.cpu_count() or 1) + 4) + validation_lanes.GRAMMAR_THREADS

    async def scenario() -> str:
        blocked = [asyncio.ensure_future(run_in_lane(request, release.wait, 30))
                   for request in [LONG] * num_blocked + [SCHEMA] * num_blocked]
        await asyncio.sleep(0.05)  # the blocked ones hold every thread of their lanes
        try:
            return await asyncio.wait_for(run_in_lane(SHORT, lambda: "validated"), timeout=10)
        finally:
            release.set()
            assert all(await asyncio.gather(*blocked))

    assert asyncio.run(scenario()) == "validated"


def test_errors_and_context_variables_cross_the_lane() -> None:
    import contextvars

    tenant = contextvars.ContextVar("tenant", default="")

    def fail() -> None:
        raise ValueError(f"refused for {tenant.get()!r}")

    async def scenario() -> None:
        tenant.set("a")
        assert await run_in_lane(LONG, tenant.get) == "a"
        with pytest.raises(ValueError, match="refused for 'a'"):
            await run_in_lane(SHORT, fail)

    asyncio.run(scenario())
