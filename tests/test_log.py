"""What tpserve's logging writes (docs/design/operations.md, "Logs"): no request content in tracebacks, bounded
tracebacks,
control characters escaped, repeated warnings rate-limited, exceptions in JSON lines.

Each format is configured with ``configure_logging`` in a child process (the configuration
is process-wide), which logs what a server would: an internal error whose frames hold a
prompt in their locals, 60 frames deep, with a client's ``request_id`` holding ANSI escapes
and a forged line, and a message of 50,000 characters.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import structlog

PROMPT = "my confidential prompt about patient 1234"

_SCRIPT = f"""
import structlog
from tpserve.log import configure_logging

configure_logging({{fmt!r}})
log = structlog.get_logger("test")


def handler(depth, prompt):
    request = {{{{"prompt": prompt, "max_tokens": 16}}}}
    if depth == 0:
        raise RuntimeError("the step failed" + "!" * 50_000)  # a long message: bounded too
    handler(depth - 1, prompt)


try:
    handler(60, {PROMPT!r})
except RuntimeError:
    log.exception("internal error", request_id="abc\\x1b[2J\\x1b[31mred",
                  method="m\\r\\n2026-01-01 [info] forged line")
for _ in range(50):
    log.warning("unauthenticated call refused", method="/tpserve.v1.Generation/Generate")
log.info("done")
"""


def _run(fmt: str) -> str:
    done = subprocess.run([sys.executable, "-c", _SCRIPT.format(fmt=fmt)], capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stderr


def test_console_traceback_has_no_locals_is_bounded_and_escapes_control_characters() -> None:
    err = _run("console")
    assert PROMPT not in err and "max_tokens" not in err  # before: rich printed every frame's locals
    assert "RuntimeError: the step failed!!!" in err and len(err) < 20_000
    lines = err.splitlines()
    assert len(lines) < 60, len(lines)  # before: about 3,000 lines for 60 frames with locals
    assert err.count('handler(depth - 1, prompt)') <= 20  # the innermost frames only
    assert "\x1b" not in err and "\r" not in err
    assert err.count("unauthenticated call refused") == 1  # 49 more within the minute: counted, not written
    assert "request_id=abc\\x1b[2J\\x1b[31mred" in err  # before: written raw, clearing the operator's screen
    assert not any(line.startswith("2026-01-01 [info] forged line") for line in lines)


def test_json_lines_carry_the_exception_bounded_without_locals() -> None:
    err = _run("json")
    entries = [json.loads(line) for line in err.splitlines()]
    assert [e["event"] for e in entries] == ["internal error", "unauthenticated call refused", "done"]
    (exception,) = entries[0]["exception"]  # before: the traceback was dropped ("exc_info": true)
    assert exception["exc_type"] == "RuntimeError"
    assert exception["exc_value"] == "the step failed" + "!" * (16_000 - 15) + "... (34015 characters cut)"
    frames = exception["frames"]  # the outermost and innermost 10, and one naming the 42 skipped (62 in all)
    assert len(frames) == 21 and frames[10]["name"] == "Skipped frames: 42"
    assert all("locals" not in frame for frame in frames)
    assert PROMPT not in err
    assert entries[0]["request_id"].startswith("abc\\x1b[2J")


def test_repeated_warnings_are_counted_not_written() -> None:
    from tpserve.log import RATE_LIMIT_WINDOW_S, RateLimitWarnings

    now = [0.0]
    out: list[dict] = []
    log = structlog.wrap_logger(None, processors=[RateLimitWarnings(clock=lambda: now[0]),
                                                  lambda _l, _m, event: out.append(event) or ""],
                                wrapper_class=structlog.make_filtering_bound_logger(20))
    for _ in range(58):
        log.warning("unauthenticated call refused", method="/tpserve.v1.Generation/Generate")
        log.info("info lines are not limited")
    log.warning("another warning")
    now[0] = RATE_LIMIT_WINDOW_S + 1
    log.warning("unauthenticated call refused", method="/tpserve.v1.Generation/Generate")
    refused = [e for e in out if e["event"].startswith("unauthenticated")]
    assert [e["event"] for e in refused] == [
        "unauthenticated call refused",
        "unauthenticated call refused (suppressed 57 similar in the last 60 s)"]
    assert refused[1]["num_suppressed"] == 57
    assert sum(e["event"] == "info lines are not limited" for e in out) == 58
    assert sum(e["event"] == "another warning" for e in out) == 1


@pytest.mark.parametrize("text, escaped", [("a\x1b[31mb", "a\\x1b[31mb"), ("x\ny", "x\\x0ay"),
                                           ("\x9b2J", "\\x9b2J"), ("naïve 日本", "naïve 日本")])
def test_escape_control(text: str, escaped: str) -> None:
    from tpserve.log import escape_control

    assert escape_control(text) == escaped


_LINES_SCRIPT = """
import logging, os, structlog
from tpserve.log import configure_logging

writes = []
real_write = os.write
os.write = lambda fd, data: writes.append(data) or real_write(fd, data)
configure_logging("console", rank=3)
structlog.get_logger("test").info("step done", detail="x" * 3000)
logging.getLogger("grpc").warning("from the standard library")
os.write = real_write
print(len(writes), [w.count(b"\\n") for w in writes], flush=True)
"""


def test_every_record_is_one_whole_line_in_one_write() -> None:
    """The ranks of a group share one stderr: a line written in pieces (``print`` writes the message and its
    newline apart) can take another rank's line inside it. Each record is one ``write(2)`` of one line."""
    done = subprocess.run([sys.executable, "-c", _LINES_SCRIPT], capture_output=True, text=True, timeout=60,
                          check=True)
    assert done.stdout.strip() == "2 [1, 1]", done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and "step done" in lines[0] and "rank=3" in lines[0] and "x" * 3000 in lines[0]
    # The standard library's records (grpc's, asyncio's) through the same processors: stamped, levelled, named.
    assert "[warning  ] from the standard library" in lines[1] and lines[1].endswith(" [grpc] rank=3"), lines[1]


def test_grpc_core_lines_are_silenced_in_the_server_processes() -> None:
    """gRPC's C core would print ``E... add_port.cc:83] Failed to add port`` in its own format before our line."""
    script = ("import launch  # first, as the server processes do (tpserve serve, python -m launch.cli)\n"
              "import os, socket, grpc\n"
              "from concurrent.futures import ThreadPoolExecutor\n"
              "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
              "server = grpc.server(ThreadPoolExecutor(1))\n"
              "try:\n    server.add_insecure_port(f'127.0.0.1:{s.getsockname()[1]}')\n"
              "except RuntimeError:\n    print(os.environ['GRPC_VERBOSITY'])\n")
    env = {key: value for key, value in __import__("os").environ.items() if key != "GRPC_VERBOSITY"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.stdout.strip() == "NONE" and "add_port" not in done.stderr, done.stderr


_STDLIB_SCRIPT = """
import asyncio, gc, logging
from tpserve.log import configure_logging

configure_logging("json", rank=1)
try:
    raise RuntimeError("a batch failed\\n  File forged")
except RuntimeError:
    logging.getLogger("grpc._cython.cygrpc").exception("ExecuteBatchError raised in core by servicer method [%s]",
                                                       "/tpserve.v1.Generation/Generate")


async def fails():
    raise ValueError("never read")


async def main():
    asyncio.ensure_future(fails())
    await asyncio.sleep(0.01)

asyncio.run(main())
gc.collect()
"""


def test_the_standard_library_s_records_are_json_lines_too() -> None:
    """grpc's and asyncio's records, tracebacks included, are one JSON object per line under ``--log-format json``
    (before: their messages and tracebacks came out as plain lines between the JSON ones)."""
    done = subprocess.run([sys.executable, "-c", _STDLIB_SCRIPT], capture_output=True, text=True, timeout=60,
                          check=True)
    entries = [json.loads(line) for line in done.stderr.splitlines()]
    assert [(e["logger"], e["level"], e["rank"]) for e in entries] == [("grpc._cython.cygrpc", "error", 1),
                                                                       ("asyncio", "error", 1)], done.stderr
    assert entries[0]["event"] == "ExecuteBatchError raised in core by servicer method [/tpserve.v1.Generation/Generate]"
    assert [(x["exc_type"], x["exc_value"]) for x in entries[0]["exception"]] == [
        ("RuntimeError", "a batch failed\n  File forged")]
    assert entries[1]["event"].startswith("Task exception was never retrieved")
    assert entries[1]["exception"][0]["exc_value"] == "never read"
