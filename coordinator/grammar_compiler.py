"""Grammar compilation in separate processes, under a time limit (docs/design/sampling.md, "Grammars compile in child
processes").

llguidance compiles a JSON schema, regex or Lark grammar in Rust. It releases the GIL
while it works, but a compile cannot be interrupted: a hostile schema (deep ``anyOf``,
``allOf`` of many ``anyOf``, which multiply out) could keep a thread, and a CPU core,
busy for tens of seconds after its client gave up. So compiles run in a small pool of
child processes (``python -m coordinator.grammar_compiler``, as the ranks are started;
``nice`` 10: serving keeps most of the CPUs). The validation thread sends ``(kind, source)``
down a pipe and waits. The limit, ``timeout_s``, is CPU time, the child's own (Linux's
``/proc/<pid>/stat``): a grammar that needs more than that is refused (INVALID_ARGUMENT)
whatever the load, its child killed (a fresh one started in its place). Wall time was
the limit before: a regex compiling in 0.5 s alone was refused as invalid under a load of 48
streams, and accepted again alone, a permanent error code for a passing condition. A compile
that a busy host starves (less than the limit in CPU time after :data:`WALL_SECONDS_PER_LIMIT`
limits of wall time) is ended with RESOURCE_EXHAUSTED and a pushback: retryable. Where no
process CPU time can be read, the limit is wall time, as before. Children start on the first
grammar (a server that never sees one runs none); their start-up (about a second) is not
part of the limit.

A child builds the grammar exactly as rank 0 will (tpserve/llguidance_setup.py: the
model's llguidance tokenizer and the shared parser limits), so a grammar that compiled
here builds on the rank, in about the same time, which the limit bounds, and an invalid
one never reaches a rank. Results (grammars and refusals, not time-outs) are cached by
source. A child also checks a continued request's tokens against its grammar
(:meth:`GrammarCompiler.count_accepted`, docs/design/cluster.md, "A continuation is checked like output"), under the
same kind of limit. No torch.
"""

from __future__ import annotations

import os
import signal
import queue
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

from coordinator.errors import ResourceExhaustedError, UnavailableError
from coordinator.pushback import MIN_PUSHBACK_MS

Kind = Literal["json_schema", "regex"]
#: Default compile-time limit, in seconds: legitimate schemas compile in milliseconds.
MAX_COMPILE_SECONDS = 1.0
#: Longest wait for a child's start-up (interpreter, llguidance, the tokenizer: ~1-2 s idle).
_START_TIMEOUT_S = 60.0
_CACHE_SIZE = 256
#: Seconds beyond two limits a compile may wait for a free child before RESOURCE_EXHAUSTED.
_QUEUE_SLACK_S = 2.0
#: Wall time a compile may take, in limits of CPU time, before a starved one is ended as the host's fault: a
#: child at ``nice`` 10 on a saturated host gets about a tenth of a core, so ten limits still fit a whole one.
WALL_SECONDS_PER_LIMIT = 10.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: Time a token check may take per token, beyond the compile limit (llguidance advances a
#: grammar by a token in microseconds; its parser limits bound the worst case).
CHECK_SECONDS_PER_TOKEN = 1e-3


class GrammarCompileTimeout(Exception):
    """The compile took longer than the limit (its child was killed)."""


def compile_format(kind: Kind, source: str, tokenizer=None) -> str:
    """The llguidance grammar of a JSON schema or regex, checked by building it.

    Args:
        kind: ``json_schema`` (JSON text; compact output, no free whitespace) or ``regex``.
        source: the schema or the regex.
        tokenizer: an ``llguidance.LLTokenizer``: the grammar is built as a rank builds it
            (a full matcher); None checks it without a tokenizer (``validate_grammar``).

    Raises:
        ValueError: llguidance refuses it (syntax, unsupported keyword, a parser limit).
    """
    import llguidance

    from tpserve.llguidance_setup import build_matcher, parser_limits

    if kind == "json_schema":  # serde's JSON parser: ValueError past 128 nesting levels
        grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults={"whitespace_flexible": False})
    else:
        grammar = llguidance.LLMatcher.grammar_from_regex(source)
    if tokenizer is None:
        error = llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits())
        if error:
            raise ValueError(error.strip()[:500])
    else:
        build_matcher(tokenizer, grammar)
    return grammar


def count_accepted_tokens(grammar: str, token_ids: list[int], tokenizer) -> int:
    """How many of ``token_ids``, from the grammar's start, ``grammar`` accepts (``len(token_ids)``: all).

    Args:
        grammar: an llguidance grammar (:func:`compile_format`'s).
        token_ids: output tokens, in order.
        tokenizer: the model's ``llguidance.LLTokenizer``.

    Raises:
        ValueError: llguidance refuses the grammar.
    """
    from tpserve.llguidance_setup import build_matcher

    return build_matcher(tokenizer, grammar).validate_tokens(token_ids)


def _serve(conn_in: Connection, conn_out: Connection, model_dir: str, vocab_size: int) -> None:
    """A child's loop: ``(kind, source)`` in, ``("ok", grammar)`` or ``("error", message)`` out;
    ``("tokens", grammar, token_ids)`` in, ``("ok", number accepted)`` out."""
    try:
        os.nice(10)  # behind the ranks and the coordinator on a busy host (module docstring)
    except OSError:
        pass
    from tpserve.llguidance_setup import llg_tokenizer

    tokenizer = llg_tokenizer(model_dir, vocab_size)
    conn_out.send(("ready", ""))
    while True:
        try:
            message = conn_in.recv()
        except (EOFError, OSError):
            return  # the coordinator is gone
        try:
            if message[0] == "tokens":
                conn_out.send(("ok", count_accepted_tokens(message[1], list(message[2]), tokenizer)))
            else:
                conn_out.send(("ok", compile_format(message[0], message[1], tokenizer)))
        except ValueError as exc:
            conn_out.send(("error", str(exc)))


class _Child:
    """One compile process and its two pipes."""

    def __init__(self, model_dir: str, vocab_size: int) -> None:
        child_reads, parent_writes = os.pipe()
        parent_reads, child_writes = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "coordinator.grammar_compiler", str(child_reads), str(child_writes), model_dir,
             str(vocab_size)], pass_fds=(child_reads, child_writes), stdin=subprocess.DEVNULL)
        os.close(child_reads)
        os.close(child_writes)
        self.send_conn = Connection(parent_writes, readable=False)
        self.conn = Connection(parent_reads, writable=False)
        self.ready = False

    def send(self, message: tuple) -> None:
        self.send_conn.send(message)

    def wait_ready(self) -> None:
        if self.ready:
            return
        if not self.conn.poll(_START_TIMEOUT_S):
            raise UnavailableError("the grammar compiler did not start")
        try:
            self.conn.recv()
        except (EOFError, OSError):
            raise UnavailableError(f"the grammar compiler exited (code {self.process.poll()})") from None
        self.ready = True

    def cpu_seconds(self) -> float | None:
        """User and system CPU seconds the child has used, from ``/proc`` (None where there is none)."""
        try:
            with open(f"/proc/{self.process.pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime: fields 14 and 15 of proc(5)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(5)
        self.send_conn.close()
        self.conn.close()


class GrammarCompiler:
    """A pool of compile processes with a time limit and a cache.

    Args:
        model_dir: the checkpoint (its ``tokenizer.json``), as the ranks load it.
        vocab_size: rows of the model's logits.
        timeout_s: most seconds of CPU time one compile may take (> 0).
        num_processes: children (compiles in parallel).
        wall_factor: most wall time a compile may take, in ``timeout_s`` (>= 1).

    Thread-safe: :meth:`compile` blocks its thread (the server validates requests on
    worker threads, never on the event loop).
    """

    def __init__(self, model_dir: str | Path, vocab_size: int, timeout_s: float = MAX_COMPILE_SECONDS,
                 num_processes: int = 2, wall_factor: float = WALL_SECONDS_PER_LIMIT) -> None:
        if not timeout_s > 0 or num_processes < 1 or not wall_factor >= 1:
            raise ValueError(f"timeout_s must be > 0, num_processes >= 1 and wall_factor >= 1, got {timeout_s}, "
                             f"{num_processes}, {wall_factor}")
        self.model_dir, self.vocab_size = str(model_dir), vocab_size
        self.timeout_s, self.wall_factor = timeout_s, wall_factor
        self._idle: queue.Queue[_Child] = queue.Queue()
        self._num_processes = num_processes
        self._num_started = 0  # children are started on demand: a server without grammars has none
        self._cache: OrderedDict[tuple[str, str], tuple[str, str]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def compile(self, kind: Kind, source: str) -> str:
        """The llguidance grammar of ``source`` (see :func:`compile_format`), built in a child.

        Raises:
            ValueError: llguidance refuses it; the message is llguidance's.
            GrammarCompileTimeout: it took more than ``timeout_s`` seconds of CPU time.
            ResourceExhaustedError: no child came free within two limits (a flood of compiles), or a busy host
                gave the compile less than the limit in ``wall_factor`` limits of wall time.
            UnavailableError: the compiler is closed or a child could not start.
        """
        key = (kind, source)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                status, value = self._cache[key]
                return _result(status, value, self.timeout_s)
        status, value = self._ask(key, self.timeout_s)
        if status not in ("timeout", "busy"):  # a time may differ on the next try (a busy host, a limit's edge)
            with self._lock:
                self._cache[key] = (status, value)
                if len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return _result(status, value, self.timeout_s)

    def count_accepted(self, grammar: str, token_ids: list[int]) -> int:
        """How many of ``token_ids`` ``grammar`` accepts from its start (:func:`count_accepted_tokens`),
        in a child, within ``timeout_s`` plus :data:`CHECK_SECONDS_PER_TOKEN` a token.

        Raises:
            ValueError: llguidance refuses the grammar.
            GrammarCompileTimeout: it took longer than that (the message gives the limit).
            ResourceExhaustedError, UnavailableError: as :meth:`compile`.
        """
        limit = self.timeout_s + len(token_ids) * CHECK_SECONDS_PER_TOKEN
        status, value = self._ask(("tokens", grammar, tuple(token_ids)), limit)
        return int(_result(status, value, limit))

    def _ask(self, message: tuple, timeout_s: float) -> tuple[str, Any]:
        """Sends ``message`` to a free child and waits at most ``timeout_s`` for its ``(status, value)``;
        ``("timeout", "")`` when it takes longer (the child is killed and replaced)."""
        if self._closed:
            raise UnavailableError("the grammar compiler is closed")
        child = self._take_child()
        try:
            child.wait_ready()
            child.send(message)
            status, value = self._wait(child, timeout_s, self.wall_factor)
            if status != "ok" and status != "error":
                child.kill()  # the work cannot be interrupted: end its process
                child = _Child(self.model_dir, self.vocab_size)
        except (EOFError, OSError, UnavailableError):
            child.kill()
            child = _Child(self.model_dir, self.vocab_size)
            raise UnavailableError("the grammar compiler failed; retry") from None
        finally:
            child.kill() if self._closed else self._idle.put(child)
        return status, value

    @staticmethod
    def _wait(child: _Child, limit_s: float, wall_factor: float) -> tuple[str, Any]:
        """``child``'s answer; ``("timeout", "")`` once it has used ``limit_s`` seconds of CPU time (of wall time
        where that cannot be read), ``("busy", "")`` once the wall time reaches ``wall_factor`` limits first."""
        started_cpu, wall_deadline = child.cpu_seconds(), time.monotonic() + wall_factor * limit_s
        used = 0.0
        while not child.conn.poll(max(limit_s - used, 0.01)):  # it cannot use its CPU left in less wall time
            if started_cpu is None or (now_cpu := child.cpu_seconds()) is None:
                return "timeout", ""
            used = now_cpu - started_cpu
            if used >= limit_s:
                return "timeout", ""
            if time.monotonic() >= wall_deadline:
                return "busy", ""
        return child.conn.recv()

    def _take_child(self) -> _Child:
        """An idle child, a new one while fewer than ``num_processes`` run, else the next to be free."""
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            start = self._num_started < self._num_processes
            self._num_started += start
        if start:
            return _Child(self.model_dir, self.vocab_size)
        try:  # a busy child is free (or killed and replaced) within one limit
            return self._idle.get(timeout=2 * self.timeout_s + _QUEUE_SLACK_S)
        except queue.Empty:
            raise ResourceExhaustedError("every grammar compiler is busy; retry shortly", MIN_PUSHBACK_MS) from None

    def close(self) -> None:
        """Ends every child (idempotent)."""
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return


def _result(status: str, value: Any, timeout_s: float) -> Any:
    if status == "ok":
        return value
    if status == "timeout":
        raise GrammarCompileTimeout(f"{timeout_s:g} s")
    if status == "busy":
        raise ResourceExhaustedError(f"the host was too busy to build the grammar (its limit: {timeout_s:g} s of CPU "
                                     "time); retry", MIN_PUSHBACK_MS)
    raise ValueError(value)


if __name__ == "__main__":  # a child: read fd, write fd, model directory, vocabulary size
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the server, which stops us
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False),
           sys.argv[3], int(sys.argv[4]))
