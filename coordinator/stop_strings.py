"""Stop strings: cut one sequence's completion text at the first stop string, as it streams.

A stop string is matched on text, not tokens: it may begin or end inside a token and
span any number of deltas. The matcher sits between the detokenizer and the client:

    delta -> held tail + delta -> (a) a stop string occurs: emit the text before it, stop
                               -> (b) none: emit all but the longest tail that could
                                      still begin a stop string; hold that tail

The held tail is a proper prefix of some stop string, so at most ``max(len(stop)) - 1``
characters, and each push scans only tail + delta (never the whole text). A match
must therefore start inside tail + delta: text before the tail was released only
once no stop string could begin there.

"First" stop means the one whose last character comes first in the text (what a
streaming reader sees complete first), and among those ending at the same character
the one that starts earlier (the longer). This makes the result independent of how
the text is split into deltas: stops "bc" and "abcd" on "abcd" cut at "a".
Lengths and positions are in Unicode code points (Python ``str`` indices).

``min_tokens`` (vLLM's rule, v1's detokenizer): no stop string is matched in the text of the first
``min_tokens`` output tokens; a match must end in the text of a later token (it may start before).
Such text is still held back where it may begin a stop string, so one that ends after the
boundary is found; one that ended before it is not, however long it is held.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Holds back text that may begin a stop string and cuts the text at the first match.

    Args:
        stop: the stop strings (duplicates allowed; none is fine: text passes through).
        include_stop: keep the matched stop string at the end of the text
            (``include_stop_str_in_output``); what follows it is dropped all the same.
        min_tokens: output tokens whose text no match may end in (the request's ``min_tokens``).

    Raises:
        ValueError: a stop string is empty (it would match before any text).
        TypeError: a stop string is not a ``str``.
    """

    def __init__(self, stop: Sequence[str], include_stop: bool = False, min_tokens: int = 0) -> None:
        for s in stop:
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be str, got {type(s).__name__}")
            if not s:
                raise ValueError("stop strings must be non-empty; got an empty string")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stop))  # order kept, duplicates gone
        self._max_held = max((len(s) for s in self._stops), default=1) - 1  # in characters
        self._first_chars = frozenset(s[0] for s in self._stops)
        self._held = ""
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self.stopped = False

    @property
    def held_text(self) -> str:
        """Text received but not yet emitted, because a stop string may begin there."""
        return self._held

    def push(self, delta: str, num_tokens: int | None = None) -> tuple[str, bool]:
        """Adds a text delta; returns (text safe to emit now, whether a stop string matched).

        On a match the returned text ends just before the stop string (or with it,
        with ``include_stop``); everything after it is dropped, and later pushes
        return ``("", True)``. ``num_tokens``: the output tokens so far, those whose text
        ``delta`` is included; at most ``min_tokens``, nothing matches (None: no such rule).
        """
        if self.stopped:
            return "", True
        if not self._stops:
            return delta, False
        text = self._held + delta
        match = self._first_match(text, len(self._held)) \
            if num_tokens is None or num_tokens > self._min_tokens else None
        if match is not None:
            self.stopped = True
            self._held = ""
            start, end = match
            return text[:end if self._include_stop else start], True
        cut = self._hold_from(text)
        self._held = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        """Releases the held text when the sequence ends without a stop string (eos, length)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str, held: int) -> tuple[int, int] | None:
        """(start, end) in ``text`` of the stop string that ends first after its first ``held`` characters (the
        held text: it holds a whole stop string only where ``min_tokens`` kept it from matching), or None."""
        best: tuple[int, int] | None = None  # (end, start)
        for s in self._stops:
            start = text.find(s, max(held - len(s) + 1, 0))
            if start >= 0 and (best is None or (start + len(s), start) < best):
                best = (start + len(s), start)
        return None if best is None else (best[1], best[0])

    def _hold_from(self, text: str) -> int:
        """Index where the longest suffix of ``text`` that begins some stop string starts."""
        for i in range(max(len(text) - self._max_held, 0), len(text)):
            if text[i] in self._first_chars and any(s.startswith(text[i:]) for s in self._stops):
                return i
        return len(text)
