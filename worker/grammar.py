"""Structured output on the sampling rank: llguidance token masks, one matcher per sequence.

The coordinator turns a request's ``response_format`` (JSON schema, regular expression
or choices) into an llguidance grammar and builds it once in a child process under a
time limit (coordinator/grammar_compiler.py), with the same tokenizer and parser limits
as here (tpserve/llguidance_setup.py): a grammar that reaches a rank is valid and builds
in about the time the coordinator measured. It rides in ``SamplingParams.grammar``.
Rank 0 keeps one ``LLMatcher`` per sequence that has one.
Before each sample the matcher is advanced by the output tokens the sequence was fed
since (its token history, the same one the penalties use, so a preempted or
prefix-cached sequence rebuilds its state from its tokens), then asked for the mask
of allowed next tokens; disallowed logits become ``-inf`` before anything else
(worker/logits_processors.py).

The tokens that end the sequence (``SamplingParams.grammar_stop_ids``: the model's eos
ids, as the coordinator stops on them) are allowed exactly where the grammar accepts
(docs/design/sampling.md, "A grammar request ends only where its grammar does"): llguidance knows one eos, and an
extra eos id of
``generation_config.json`` that is also ordinary text ("i") would otherwise end a JSON
string half-way, reported as a complete stop.

Compiled grammars are cached by grammar text: the first sequence with a grammar pays
the build, the next ones deep-copy the pristine matcher. The build starts on a
background thread as soon as a plan brings the sequence (:meth:`GrammarCache.prefetch`),
so it overlaps the step's forward pass (llguidance releases the GIL while it builds). The llguidance tokenizer
(from the checkpoint's ``tokenizer.json``, about a second) is built once, on the first
structured request. No work at all for a batch without grammars.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tpserve.llguidance_setup import build_matcher, checkpoint_eos_token_ids, llg_tokenizer

_MAX_CACHED_GRAMMARS = 64


class GrammarCache:
    """One model's llguidance tokenizer and compiled grammars.

    Args:
        model_dir: the checkpoint (its ``tokenizer.json``, ``config.json`` and
            ``generation_config.json`` for the eos ids).
        vocab_size: rows of the logits (masks are this wide).
    """

    def __init__(self, model_dir: str | Path, vocab_size: int) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self._tokenizer = None
        self.eos_token_ids: list[int] = checkpoint_eos_token_ids(self.model_dir)
        self._pristine: dict[str, object] = {}
        self._pending: dict[str, Future] = {}
        self._builder: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # the step thread and PrepareGrammar's gRPC threads
        self._tokenizer_lock = threading.Lock()

    def prefetch(self, grammar: str) -> Future | None:
        """Starts building ``grammar`` on the background thread unless it is built or being built.

        Returns:
            The build's future, or None when the grammar is already built.
        """
        with self._lock:
            if grammar in self._pristine:
                return None
            pending = self._pending.get(grammar)
            if pending is None:
                if self._builder is None:
                    self._builder = ThreadPoolExecutor(1, thread_name_prefix="grammar-build")
                if len(self._pending) >= _MAX_CACHED_GRAMMARS:  # sequences that ended before sampling
                    self._pending.pop(next(iter(self._pending)))
                pending = self._pending[grammar] = self._builder.submit(self._build, grammar)
            return pending

    def prepare(self, grammar: str) -> None:
        """Builds ``grammar`` (blocking, on the background thread) so that no step has to.

        Raises:
            ValueError: llguidance rejects the grammar.
        """
        pending = self.prefetch(grammar)
        if pending is not None:
            pending.result()

    def _build(self, grammar: str):
        return build_matcher(self._llm_tokenizer(), grammar)

    def _llm_tokenizer(self):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = llg_tokenizer(self.model_dir, self.vocab_size)
            return self._tokenizer

    def matcher(self, grammar: str):
        """A fresh ``LLMatcher`` for ``grammar`` (compiled once per grammar text).

        Raises:
            ValueError: llguidance rejects the grammar (the coordinator built it first).
        """
        with self._lock:
            pristine = self._pristine.get(grammar)
            pending = self._pending.pop(grammar, None) if pristine is None else None
        if pristine is None:
            try:
                pristine = pending.result() if pending is not None else self._build(grammar)
            except ValueError as exc:
                raise ValueError(f"grammar rejected: {exc}") from None
            with self._lock:
                if len(self._pristine) >= _MAX_CACHED_GRAMMARS:
                    self._pristine.pop(next(iter(self._pristine)))
                self._pristine[grammar] = pristine
        return pristine.deep_copy()

    def forget(self, grammar: str) -> None:
        """Drops ``grammar``'s compiled matcher: its copies share the lexer llguidance builds lazily, and one
        that hit a parser limit leaves it failed for every later copy; the next sequence builds afresh."""
        with self._lock:
            self._pristine.pop(grammar, None)


class GrammarState:
    """A sequence's matcher and how many of its output tokens it has consumed."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.num_consumed = 0

    def allowed(self, output_tokens: list[int], cache: GrammarCache, stop_ids: Sequence[int] = ()) -> np.ndarray:
        """``(V,) bool`` tokens allowed after ``output_tokens`` (all the sequence's outputs so far).

        ``stop_ids`` (ids in [0, V)) are allowed if and only if the grammar accepts here;
        without any (an old coordinator), the checkpoint's eos ids stand in. No token at all (a dead
        end: the grammar has no continuation in this vocabulary, or llguidance hit a parser limit,
        :attr:`error`) is the caller's to report: sampling under an empty mask would pick token 0.
        """
        vocab_size = cache.vocab_size
        stop_ids = list(stop_ids) or cache.eos_token_ids
        for token in output_tokens[self.num_consumed:]:
            self.matcher.consume_token(token)
        self.num_consumed = len(output_tokens)
        if self.matcher.is_error():  # a parser limit hit on the way (the mask allowed the token): a dead end
            return np.zeros(vocab_size, dtype=bool)
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)
        if self.matcher.is_error():  # the mask itself hit a limit: llguidance's mask is then its eos alone
            return np.zeros(vocab_size, dtype=bool)
        if stop_ids:
            if self.matcher.is_stopped():  # complete: only an end, and only ours (not llguidance's eos)
                mask[:] = False
            mask[stop_ids] = self.matcher.is_accepting()
        return mask

    @property
    def error(self) -> str:
        """llguidance's error once the matcher failed (a parser limit), else ``""``."""
        return self.matcher.get_error().strip()[:500] if self.matcher.is_error() else ""
