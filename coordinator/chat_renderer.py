"""Chat templates rendered with bounded time and memory, in killable processes.

A chat template comes with the checkpoint, so it is code the operator did not write,
and Jinja has no limit of its own: nested loops over ``range(100000)`` run for hours,
``'x' * 10**10`` asks for 10 GB, and one C-level operation (``10 ** 10 ** 9``) cannot
be interrupted at all. Run on a thread, such a render cannot be stopped: it keeps its
thread (of the event loop's default executor, which then starves every request), and
the interpreter waits for it at exit, so SIGTERM no longer stops the server (docs/design/request-path.md,
"Chat templates render in killable processes"). A sandbox that counts loop iterations or output size
would not stop a single
huge operation either. So each render runs in a renderer process
(:mod:`coordinator.chat_render_worker`): at most ``size`` of them, each with a limited
address space; a render that takes longer than ``timeout_s``, or whose request is
cancelled (client cancel or deadline), kills its process, and the next render starts a
fresh one. A refused render is INVALID_ARGUMENT naming ``messages``. Nothing holds a
thread: the event loop awaits the process's pipe.

No torch.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import structlog

from coordinator.chat_render_worker import frame
from coordinator.errors import InvalidArgumentError, UnavailableError

log = structlog.get_logger(__name__)

#: Longest render: real templates take milliseconds, even over 1 MiB of contents.
RENDER_TIMEOUT_S = 2.0
#: Renderer processes at once (each about 50 MiB); more renders wait for one.
NUM_RENDERERS = 2
#: A renderer must start (import jinja2) within this, even on a loaded host.
_START_TIMEOUT_S = 60.0
#: Processes started for one render before it fails with UNAVAILABLE.
_START_ATTEMPTS = 2
#: The renderer's module (``python -m``).
_WORKER_MODULE = "coordinator.chat_render_worker"
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


class _Renderer:
    """One renderer process and its pipes."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls) -> _Renderer:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")])))
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", _WORKER_MODULE, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=env)
        renderer = cls(process)
        try:
            await asyncio.wait_for(renderer.read(), _START_TIMEOUT_S)  # {"ready": true}
        except asyncio.IncompleteReadError:  # it ended before it was ready: say how
            code = await process.wait()
            raise OSError(f"the renderer process exited with code {code} before it was ready") from None
        except BaseException:
            renderer.kill()
            raise
        return renderer

    async def read(self) -> dict[str, Any]:
        (size,) = struct.unpack(">I", await self.process.stdout.readexactly(4))
        return json.loads(await self.process.stdout.readexactly(size))

    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        self.process.stdin.write(frame(request))
        await self.process.stdin.drain()
        return await self.read()

    def kill(self) -> None:
        """Ends the process at once (asyncio's child watcher reaps it)."""
        if self.process.returncode is None:
            try:
                self.process.kill()
            except ProcessLookupError:
                pass


class ChatRenderPool:
    """Renders chat templates in at most ``size`` renderer processes, started when first needed.

    Args:
        size: most renderer processes (and renders at once); later renders wait.
        timeout_s: longest render, in seconds.
    """

    def __init__(self, size: int = NUM_RENDERERS, timeout_s: float = RENDER_TIMEOUT_S) -> None:
        if size < 1 or not timeout_s > 0:
            raise ValueError(f"size ({size}) must be >= 1 and timeout_s ({timeout_s}) > 0")
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(size)
        self._idle: list[_Renderer] = []
        self._live: set[_Renderer] = set()
        self._killed: list[asyncio.subprocess.Process] = []  # until their ends are seen (close() waits)
        self._closed = False

    async def render(self, template: str, messages: list[dict[str, str]], special_tokens: dict[str, str]) -> str:
        """The text of ``messages`` rendered with ``template`` (see :func:`coordinator.chat.render_chat`).

        Cancelling the awaiting task kills the render's process.

        Raises:
            InvalidArgumentError: the template refuses the messages, takes longer than
                ``timeout_s``, runs out of memory, renders too much, or kills its process.
            UnavailableError: the pool is closed (the server stops), or no renderer starts.
        """
        request = {"template": template, "messages": messages, "special_tokens": special_tokens,
                   "timeout_s": self.timeout_s}
        async with self._slots:
            renderer = await self._take()
            keep = False
            try:
                reply = await asyncio.wait_for(renderer.call(request), self.timeout_s)
                keep = True
            except asyncio.TimeoutError:
                log.warning("chat template render killed", timeout_s=self.timeout_s)
                raise InvalidArgumentError(f"messages: the model's chat template took longer than {self.timeout_s:g} s "
                                           "to render them (a loop without bound?)") from None
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                raise InvalidArgumentError("messages: the model's chat template ended its renderer process "
                                           f"({type(exc).__name__})") from None
            finally:  # a timeout, a dead process or a cancelled request: this process goes
                if keep and not self._closed:
                    self._idle.append(renderer)
                else:
                    self._discard(renderer)
        if "error" in reply:
            raise InvalidArgumentError(reply["error"])
        return reply["text"]

    async def close(self) -> None:
        """Kills every renderer and waits for their ends; later renders get UNAVAILABLE."""
        self._closed = True
        for renderer in list(self._live):
            self._discard(renderer)
        self._idle.clear()
        await asyncio.gather(*(process.wait() for process in self._killed))
        await asyncio.sleep(0)  # their pipes' transports close on the next turn of the loop

    @property
    def num_processes(self) -> int:
        """Renderer processes alive now (idle or rendering)."""
        return len(self._live)

    async def _take(self) -> _Renderer:
        if self._closed:
            raise UnavailableError("the server is stopping")
        while self._idle:
            renderer = self._idle.pop()
            if renderer.process.returncode is None:
                return renderer
            self._live.discard(renderer)  # died while idle (killed from outside): start another
        for attempt in range(1, _START_ATTEMPTS + 1):
            try:
                renderer = await _Renderer.start()
                break
            except (OSError, asyncio.TimeoutError) as exc:
                # A start can fail once on a loaded host (seen twice in full test runs: the process ended
                # before its first frame); a second process is cheap, a failed chat request is not.
                log.warning("chat template renderer did not start", attempt=attempt, error=f"{type(exc).__name__}: {exc}")
                if attempt == _START_ATTEMPTS:
                    raise UnavailableError(f"no chat template renderer could start ({type(exc).__name__}: {exc})") \
                        from None
        self._live.add(renderer)
        if self._closed:  # closed while it started
            self._discard(renderer)
            raise UnavailableError("the server is stopping")
        return renderer

    def _discard(self, renderer: _Renderer) -> None:
        renderer.kill()
        self._live.discard(renderer)
        self._killed = [p for p in self._killed if p.returncode is None] + [renderer.process]
