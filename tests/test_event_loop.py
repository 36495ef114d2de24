"""tpserve/event_loop.py: the server's and the load client's loop is uvloop where installed, asyncio's otherwise."""

from __future__ import annotations

import asyncio
import sys

import pytest

from tpserve import event_loop


async def _which_loop(result: int) -> tuple[str, str, int]:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__, event_loop.running_loop_name(), result


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop is a dependency on Linux and macOS only")
def test_runs_on_uvloop_where_installed():
    module, name, result = event_loop.run(_which_loop(7))
    assert module.startswith("uvloop") and name == "uvloop" and result == 7


def test_falls_back_to_asyncio_without_uvloop(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    module, name, result = event_loop.run(_which_loop(3))
    assert module.startswith("asyncio") and name == "asyncio" and result == 3


def test_raises_what_the_coroutine_raises_and_closes_the_loop():
    loops = []

    async def fail() -> None:
        loops.append(asyncio.get_running_loop())
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        event_loop.run(fail())
    assert loops[0].is_closed()


def test_outside_a_loop_there_is_no_running_loop_name():
    with pytest.raises(RuntimeError):
        event_loop.running_loop_name()
