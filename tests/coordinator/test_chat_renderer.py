"""Chat templates rendered in bounded, killable processes (docs/design/request-path.md, "Chat templates render in
killable processes").

A checkpoint's template may never end (nested loops of ``range(100000)``) or ask for
gigabytes: the render is killed after its time limit or refused at its memory limit,
with INVALID_ARGUMENT, its process replaced; a cancelled request kills its render at
once; other renders keep working.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.chat_renderer import ChatRenderPool
from coordinator.errors import InvalidArgumentError, UnavailableError

MESSAGES = [{"role": "user", "content": "Hello"}]
GOOD = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | upper }}{% endfor %}"
#: 10^10 iterations: hours. Loops only for a content "loop", so one pool serves both kinds.
ENDLESS = ("{% if messages[0]['content'] == 'loop' %}{% for a in range(100000) %}{% for b in range(100000) %}"
           "{% endfor %}{% endfor %}{% endif %}" + GOOD)


def test_an_endless_template_is_killed_at_its_limit_and_the_pool_keeps_serving() -> None:
    async def run() -> None:
        pool = ChatRenderPool(size=2, timeout_s=0.5)
        try:
            assert await pool.render(ENDLESS, MESSAGES, {}) == "<user>HELLO"
            start = time.monotonic()
            outcomes = await asyncio.gather(*(pool.render(ENDLESS, [{"role": "user", "content": "loop"}], {})
                                              for _ in range(3)), pool.render(ENDLESS, MESSAGES, {}),
                                            return_exceptions=True)
            elapsed = time.monotonic() - start
            assert all(isinstance(o, InvalidArgumentError) and "longer than 0.5 s" in str(o) for o in outcomes[:3])
            assert outcomes[3] == "<user>HELLO"
            assert elapsed < 10, elapsed  # two at a time: two rounds of 0.5 s, plus fresh processes
            assert pool.num_processes <= 2
        finally:
            await pool.close()
        assert pool.num_processes == 0
        with pytest.raises(UnavailableError):
            await pool.render(GOOD, MESSAGES, {})

    asyncio.run(run())


def test_a_cancelled_request_kills_its_render() -> None:
    async def run() -> None:
        pool = ChatRenderPool(size=1, timeout_s=30)
        try:
            task = asyncio.create_task(pool.render(ENDLESS, [{"role": "user", "content": "loop"}], {}))
            while pool.num_processes == 0:
                await asyncio.sleep(0.01)
            (renderer,) = pool._live
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert pool.num_processes == 0
            assert await asyncio.wait_for(renderer.process.wait(), 5) != 0  # killed, not left rendering
            start = time.monotonic()
            assert await pool.render(GOOD, MESSAGES, {}) == "<user>HELLO"  # the only slot is free again
            assert time.monotonic() - start < 30
        finally:
            await pool.close()

    asyncio.run(run())


@pytest.mark.parametrize(("template", "message"), [
    ("{{ 'x' * 2000000000 }}", "needs more than 1024 MiB"),  # 2 GB
    ("{{ 'x' * 5000000 }}", "the limit is 4194304"),  # fits in memory, too long a prompt
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    ("{{ raise_exception('no such role') }}", "refused them: no such role"),
])
def test_templates_over_the_memory_and_size_limits_are_refused(template: str, message: str) -> None:
    async def run() -> None:
        pool = ChatRenderPool(size=1, timeout_s=20)
        try:
            with pytest.raises(InvalidArgumentError, match=message):
                await pool.render(template, MESSAGES, {})
            assert await pool.render(GOOD, MESSAGES, {}) == "<user>HELLO"
        finally:
            await pool.close()

    asyncio.run(run())


def test_a_renderer_that_ends_before_it_is_ready_is_replaced_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A start that fails (the process ended before its first frame) gets one more process; the render works."""
    from coordinator import chat_renderer

    starts: list[str] = []
    start = chat_renderer._Renderer.start.__func__

    async def failing_once(cls):
        module = "coordinator.no_such_module" if not starts else "coordinator.chat_render_worker"
        starts.append(module)
        monkeypatch.setattr(chat_renderer, "_WORKER_MODULE", module)
        return await start(cls)

    monkeypatch.setattr(chat_renderer._Renderer, "start", classmethod(failing_once))

    async def run() -> str:
        pool = ChatRenderPool(size=1, timeout_s=20)
        try:
            return await pool.render(GOOD, MESSAGES, {})
        finally:
            await pool.close()

    assert asyncio.run(run()) == "<user>HELLO"
    assert len(starts) == 2


def test_a_renderer_that_never_starts_is_unavailable_naming_its_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    from coordinator import chat_renderer

    monkeypatch.setattr(chat_renderer, "_WORKER_MODULE", "coordinator.no_such_module")

    async def run() -> None:
        pool = ChatRenderPool(size=1, timeout_s=20)
        try:
            await pool.render(GOOD, MESSAGES, {})
        finally:
            await pool.close()

    with pytest.raises(UnavailableError, match="exited with code 1 before it was ready"):
        asyncio.run(run())
