"""Grammar compilation in separate processes, under a time limit (docs/design/sampling.md, "Grammars compile in child
processes").

llguidance compiles a JSON schema, regex or Lark grammar in Rust. It releases the GIL
while it works, but a compile cannot be interrupted: a hostile schema (deep ``anyOf``,
``allOf`` of many ``anyOf``, which multiply out) could keep a thread, and a CPU core,
busy for tens of seconds after its client gave up. So compiles run in a small pool of
child processes (``python -m coordinator.grammar_compiler``, as the ranks are started;
``nice`` 10: serving keeps most of the CPUs, yet a compile on a saturated host still gets
about a tenth of a core within its limit). The validation thread sends ``(kind, source)``
down a pipe and waits at most ``timeout_s``; a child that takes longer is killed (a fresh
one is started in its place) and the request is refused. Children start on the first
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
        timeout_s: most seconds one compile may take (> 0).
        num_processes: children (compiles in parallel).

    Thread-safe: :meth:`compile` blocks its thread (the server validates requests on
    worker threads, never on the event loop).
    """

    def __init__(self, model_dir: str | Path, vocab_size: int, timeout_s: float = MAX_COMPILE_SECONDS,
                 num_processes: int = 2) -> None:
        if not timeout_s > 0 or num_processes < 1:
            raise ValueError(f"timeout_s must be > 0 and num_processes >= 1, got {timeout_s}, {num_processes}")
        self.model_dir, self.vocab_size = str(model_dir), vocab_size
        self.timeout_s = timeout_s
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
            GrammarCompileTimeout: it took longer than ``timeout_s`` seconds.
            ResourceExhaustedError: no child came free within two limits (a flood of compiles).
            UnavailableError: the compiler is closed or a child could not start.
        """
        key = (kind, source)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                status, value = self._cache[key]
                return _result(status, value, self.timeout_s)
        status, value = self._ask(key, self.timeout_s)
        if status != "timeout":  # a time depends on the host's load: a retry may pass
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
            if child.conn.poll(timeout_s):
                status, value = child.conn.recv()
            else:
                child.kill()  # the work cannot be interrupted: end its process
                child = _Child(self.model_dir, self.vocab_size)
                status, value = "timeout", ""
        except (EOFError, OSError, UnavailableError):
            child.kill()
            child = _Child(self.model_dir, self.vocab_size)
            raise UnavailableError("the grammar compiler failed; retry") from None
        finally:
            child.kill() if self._closed else self._idle.put(child)
        return status, value

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
    raise ValueError(value)


if __name__ == "__main__":  # a child: read fd, write fd, model directory, vocabulary size
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the server, which stops us
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False),
           sys.argv[3], int(sys.argv[4]))
