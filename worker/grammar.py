"""Structured output on the sampling rank: llguidance token masks, one matcher per sequence.

The coordinator turns a request's ``response_format`` (JSON schema, regular expression
or choices) into an llguidance grammar (coordinator/structured_output.py) that rides in
``SamplingParams.grammar``. Rank 0 keeps one ``LLMatcher`` per sequence that has one.
Before each sample the matcher is advanced by the output tokens the sequence was fed
since (its token history, the same one the penalties use, so a preempted or
prefix-cached sequence rebuilds its state from its tokens), then asked for the mask
of allowed next tokens; disallowed logits become ``-inf`` before anything else
(worker/logits_controls.py). When the grammar is complete only eos is allowed.

Compiled grammars are cached by grammar text: the first sequence with a grammar pays
the compilation, the next ones deep-copy the pristine matcher. The llguidance
tokenizer (from the checkpoint's ``tokenizer.json``, about a second) is built once, on
the first structured request. No work at all for a batch without grammars.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

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
        self.eos_token_ids: list[int] = []
        self._pristine: dict[str, object] = {}

    def _llm_tokenizer(self):
        import llguidance

        if self._tokenizer is None:
            eos: set[int] = set()
            for name in ("generation_config.json", "config.json"):
                path = self.model_dir / name
                value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
                eos.update(value if isinstance(value, list) else [] if value is None else [value])
            self.eos_token_ids = sorted(eos)
            self._tokenizer = llguidance.LLTokenizer((self.model_dir / "tokenizer.json").read_text(),
                                                     n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
        return self._tokenizer

    def matcher(self, grammar: str):
        """A fresh ``LLMatcher`` for ``grammar`` (compiled once per grammar text).

        Raises:
            ValueError: llguidance rejects the grammar (the coordinator validated it first).
        """
        import llguidance

        pristine = self._pristine.get(grammar)
        if pristine is None:
            pristine = llguidance.LLMatcher(self._llm_tokenizer(), grammar)
            if pristine.is_error():
                raise ValueError(f"grammar rejected: {pristine.get_error()}")
            if len(self._pristine) >= _MAX_CACHED_GRAMMARS:
                self._pristine.pop(next(iter(self._pristine)))
            self._pristine[grammar] = pristine
        return pristine.deep_copy()


class GrammarState:
    """A sequence's matcher and how many of its output tokens it has consumed."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.num_consumed = 0

    def allowed(self, output_tokens: list[int], cache: GrammarCache) -> np.ndarray:
        """``(V,) bool`` tokens allowed after ``output_tokens`` (all the sequence's outputs so far)."""
        vocab_size, eos_token_ids = cache.vocab_size, cache.eos_token_ids
        for token in output_tokens[self.num_consumed:]:
            self.matcher.consume_token(token)
        self.num_consumed = len(output_tokens)
        if self.matcher.is_error():  # cannot happen for tokens drawn under the mask; end the sequence
            mask = np.zeros(vocab_size, dtype=bool)
            mask[eos_token_ids] = True
            return mask
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)
