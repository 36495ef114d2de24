"""Structured logging (structlog) for every tpserve process, to stderr.

"console" is for people, "json" for log collectors (one JSON object per line).
Worker ranks bind ``rank`` to every line so a group's logs can be told apart.

What reaches the log, in both formats (docs/design/operations.md, "Logs"):

* No request content at the default level. Tracebacks never show local variables
  (structlog's default console formatter, rich's, prints every frame's locals, which
  held the prompt and the whole request: about 3,000 lines per internal error), and
  they are bounded: the innermost :data:`MAX_TRACEBACK_FRAMES` frames of each
  exception in a chain, at most :data:`MAX_TRACEBACK_CHARS` characters. JSON lines
  carry the exception as structured fields (type, message, the same bounded frames)
  under ``exception``.
* Control characters (C0, DEL, C1: ANSI escape sequences, newlines, carriage returns)
  in any string value are written escaped (``\\x1b``), so a client-chosen value such
  as a ``request_id`` cannot colour, rewrite or forge console lines.
* Warnings repeated within :data:`RATE_LIMIT_WINDOW_S` (the same event text) are
  written once; the next one after the window says how many were suppressed, e.g.
  ``unauthenticated call refused (suppressed 57 similar in the last 60 s)``, with
  ``num_suppressed=57``. A client sending bad keys in a loop cannot fill the disk.
* Every record is one line written by one ``write(2)`` call (:class:`LineWriter`), so that the
  lines of a group's processes, which share one stderr, never interleave mid-line.
* gRPC's C core writes its own lines (``add_port.cc``, ``fork_posix.cc``) straight to the file
  descriptor, in its own format, next to ours: the server's processes silence it
  (``GRPC_VERBOSITY=NONE``, set by :mod:`launch` unless the user set it). Whatever it would say
  that matters reaches the user as our own line (a port in use: ``tpserve serve: --port ...``).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Literal, TextIO

import structlog
from structlog.tracebacks import ExceptionDictTransformer

#: Innermost frames kept per exception of a traceback.
MAX_TRACEBACK_FRAMES = 20
#: Longest console traceback, in characters (a message can be long: the end is cut).
MAX_TRACEBACK_CHARS = 16_000
#: Seconds within which a repeated warning is counted, not written.
RATE_LIMIT_WINDOW_S = 60.0

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_EXCEPTION_KEYS = frozenset({"exc_info", "exception"})


def escape_control(text: str) -> str:
    """``text`` with each C0 / DEL / C1 control character written as ``\\xNN`` (newline, tab and ESC included)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def escape_control_characters(_logger: Any, _method: str, event_dict: dict) -> dict:
    """structlog processor: :func:`escape_control` on every string value, keys and nested lists/dicts too."""
    return {escape_control(k) if isinstance(k, str) else k: v if k in _EXCEPTION_KEYS else _escape_value(v)
            for k, v in event_dict.items()}


def _escape_value(value: Any) -> Any:
    if isinstance(value, str):
        return escape_control(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_escape_value(v) for v in value)
    if isinstance(value, dict):
        return {_escape_value(k): _escape_value(v) for k, v in value.items()}
    return value


def bounded_traceback(sio: TextIO, exc_info: Any) -> None:
    """Console exception formatter: a plain traceback, no locals, innermost frames only, bounded length."""
    text = "".join(traceback.format_exception(*exc_info, limit=-MAX_TRACEBACK_FRAMES))
    if len(text) > MAX_TRACEBACK_CHARS:
        text = text[:MAX_TRACEBACK_CHARS] + f"... ({len(text) - MAX_TRACEBACK_CHARS} characters cut)\n"
    sio.write("\n" + escape_control_keep_lines(text))


def escape_control_keep_lines(text: str) -> str:
    """:func:`escape_control` on each line of a multi-line text (a traceback), keeping its line breaks."""
    return "\n".join(escape_control(line) for line in text.split("\n"))


def _bound_exception_messages(_logger: Any, _method: str, event_dict: dict) -> dict:
    """structlog processor: each JSON ``exception``'s message cut to :data:`MAX_TRACEBACK_CHARS` characters."""
    for exception in event_dict.get("exception") or ():
        value = exception.get("exc_value") if isinstance(exception, dict) else None
        if isinstance(value, str) and len(value) > MAX_TRACEBACK_CHARS:
            exception["exc_value"] = value[:MAX_TRACEBACK_CHARS] + f"... ({len(value) - MAX_TRACEBACK_CHARS} " \
                                                                     "characters cut)"
    return event_dict


class RateLimitWarnings:
    """structlog processor: a warning repeated within ``window_s`` is written once, then counted.

    "Repeated": the same event text (the modules' events are distinct sentences). The first occurrence is written; the
    next ones within ``window_s`` of it are dropped and counted; the first one after
    the window is written with the count (``num_suppressed``, and in the event text) and
    opens a new window. A burst followed by silence is not summarised until the event
    recurs (no timer thread). Thread-safe (worker ranks log from several threads).

    Args:
        window_s: the window in seconds.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, window_s: float = RATE_LIMIT_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[str, list] = {}  # event -> [window start, number suppressed]

    def __call__(self, logger: Any, method: str, event_dict: dict) -> dict:
        if method not in ("warning", "warn"):
            return event_dict
        key = str(event_dict.get("event"))
        now = self._clock()
        with self._lock:
            state = self._seen.get(key)
            if state is not None and now - state[0] < self.window_s:
                state[1] += 1
                raise structlog.DropEvent
            suppressed = state[1] if state is not None else 0
            self._seen[key] = [now, 0]
            if len(self._seen) > 10_000:  # distinct events are few; never grow without bound
                self._seen = {key: self._seen[key]}
        if suppressed:
            event_dict["event"] = f"{event_dict.get('event')} (suppressed {suppressed} similar in the last " \
                                  f"{self.window_s:g} s)"
            event_dict["num_suppressed"] = suppressed
        return event_dict


def processors(fmt: Literal["console", "json"], rate_limiter: RateLimitWarnings | None = None) -> list:
    """The processor chain of ``fmt``, renderer last (tests render through it)."""
    chain: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        rate_limiter or RateLimitWarnings(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        escape_control_characters,
    ]
    if fmt == "json":
        # The exception as fields: type, message, the innermost frames, never the locals.
        transformer = ExceptionDictTransformer(show_locals=False, max_frames=MAX_TRACEBACK_FRAMES, use_rich=False)
        # JSON escapes the exception's own control characters.
        chain += [structlog.processors.ExceptionRenderer(transformer), _bound_exception_messages,
                  structlog.processors.JSONRenderer()]
    else:
        chain.append(structlog.dev.ConsoleRenderer(colors=False, exception_formatter=bounded_traceback))
    return chain


class LineWriter:
    """A text stream for log lines: each ``write`` goes to the current ``sys.stderr``'s file descriptor in
    one ``write(2)`` call (looping only on a partial write), so that a line of up to ``PIPE_BUF`` (4,096)
    bytes reaches a pipe shared by several processes whole. ``print`` (structlog's ``PrintLogger``) writes
    a message and its newline separately, and a buffered stream may split a long line: either lets another
    rank's line land inside it. A ``sys.stderr`` without a descriptor (a test's capture) is written to as is.
    """

    def write(self, text: str) -> int:
        stream = sys.stderr
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            return stream.write(text)
        stream.flush()  # what others wrote through sys.stderr goes first
        data = text.encode("utf-8", "backslashreplace")
        while data:
            data = data[os.write(fd, data):]
        return len(text)

    def flush(self) -> None:
        """Nothing is buffered."""


def configure_logging(fmt: Literal["console", "json"] = "console", level: str = "INFO", rank: int | None = None) -> None:
    """Configures structlog and the standard library's logging (grpc's, asyncio's) once per process.

    The standard library's records go through the same processors as structlog's (structlog's
    ``ProcessorFormatter``): one JSON object per line under ``json``, and under ``console`` the same
    timestamp, level and escaping, with the logger's name; their exceptions are rendered as structlog's are.
    """
    writer = LineWriter()
    chain = processors(fmt)
    handler = logging.StreamHandler(writer)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *chain[:-1]],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, chain[-1]]))
    logging.basicConfig(handlers=[handler], level=level)
    if rank is not None:
        structlog.contextvars.bind_contextvars(rank=rank)
    structlog.configure(
        processors=chain,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.WriteLoggerFactory(file=writer),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
