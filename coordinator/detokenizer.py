"""Incremental detokenization: one sequence's sampled tokens to text deltas, as they come.

Decoding token by token is wrong (a tokenizer's decoder sees context: SentencePiece
strips the space of the first token it decodes, a character made of byte-fallback
tokens is only text once all its bytes are in), and decoding the whole sequence each
step costs O(sequence length). So, as TGI's ``decode_token`` and vLLM's
``detokenize_incrementally`` do, each step decodes a short window of tokens and
keeps what the new tokens added:

    window = anchor (tokens whose text was already emitted: the context)
           + held   (tokens whose text is not yet emitted)
    delta  = decode(window)[len(decode(anchor)):]

While ``decode(window)`` ends with U+FFFD, a character is incomplete: the held tokens
wait for its next bytes, and only the complete characters before it go out (a byte-level
token may end inside one character after completing another, token after token: with
emoji-straddling vocabulary entries, a dozen in a row). Once the window decodes whole, the
rest of its delta is emitted and the held tokens become the next anchor. Both decodes start at the same token, so a leading space the
decoder strips (``Strip``, ``Metaspace``) is stripped from both and the delta keeps
its space. Special tokens (bos, eos, unk) are dropped on entry: a decode that skips
them gives the same text, and a window anchored on text keeps the stripping right.

The text of a sequence is, by definition (the goldens'), what follows the prompt:
``decode(prompt + completion)[len(decode(prompt)):]``; the concatenated deltas equal it.

Where streaming cannot equal a full decode: ``tokenizers``' ``ByteFallback`` decoder
turns a whole run of consecutive byte tokens into U+FFFD (one per byte) as soon as
the run holds one invalid byte, so a stray byte after valid multi-byte characters
would retroactively change text already sent. Here the sent characters stay, and
only bytes not yet sent come out as U+FFFD. A prompt that ends inside a character
(token-id prompts only) likewise yields U+FFFD for the completion's continuation
bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.tokenizer import Tokenizer

# Prompt tokens decoded as the first anchor, as in vLLM (its
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): enough context for any decoder we know.
_PROMPT_ANCHOR_TOKENS = 5
# How far the first anchor may reach further back so that it does not start inside a
# character (a UTF-8 character is at most 4 bytes, so at most 4 byte tokens).
_MAX_ANCHOR_BACKTRACK = 4
# A UTF-8 character is at most 4 bytes: more tokens in a row that complete no character
# while the text still ends in U+FFFD means an invalid byte run (or a token that is U+FFFD),
# which waiting cannot fix.
_MAX_HELD_TOKENS = 8

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's sampled token ids into text deltas, each step O(window).

    Args:
        tokenizer: the model's tokenizer.
        prompt_token_ids: the prompt as fed to the model (bos included or not); its
            last few tokens are the first anchor, so the first delta has the space
            it has after the prompt.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._special = tokenizer.special_token_ids
        prompt = [t for t in prompt_token_ids if t not in self._special]
        start = max(len(prompt) - _PROMPT_ANCHOR_TOKENS, 0)
        # A window that starts on a UTF-8 continuation byte decodes that byte (and, for
        # ByteFallback, its whole run) as U+FFFD, unlike the full prompt: step back.
        for _ in range(_MAX_ANCHOR_BACKTRACK):
            if start == 0 or not tokenizer.decode(prompt[start:]).startswith(_REPLACEMENT):
                break
            start -= 1
        self._window: list[int] = prompt[start:]  # anchor + held token ids
        self._num_anchor = len(self._window)
        self._anchor_text = tokenizer.decode(self._window)
        self._sent = ""  # the held tokens' complete characters, already emitted
        self._num_stalled = 0  # held tokens since the last complete character

    @property
    def num_held_tokens(self) -> int:
        """Tokens stepped whose text is not yet emitted (an incomplete character)."""
        return len(self._window) - self._num_anchor

    def step(self, token_id: int) -> str:
        """Adds one sampled token; returns the new text (may be ``""`` while held).

        The returned text never ends inside a character. Special tokens give ``""``.
        """
        if token_id in self._special:
            return ""
        window = self._window
        window.append(token_id)
        # The steady state, one anchor token and the new one: a memoized decode.
        text = self._tokenizer.decode_pair(*window) if len(window) == 2 else self._tokenizer.decode(window)
        if not text.endswith(_REPLACEMENT):
            return self._emit(text)
        sent = self._anchor_text + self._sent
        complete = text.rstrip(_REPLACEMENT)
        if text.startswith(sent) and len(complete) > len(sent):  # characters completed before the one held
            self._num_stalled = 0
            delta = complete[len(sent):]
            self._sent += delta
            return delta
        self._num_stalled += 1
        return "" if self._num_stalled < _MAX_HELD_TOKENS else self._emit(text)

    def flush(self) -> str:
        """Releases held text at the end of the sequence; invalid bytes become U+FFFD."""
        if not self.num_held_tokens:
            return ""
        return self._emit(self._tokenizer.decode(self._window))

    def _emit(self, text: str) -> str:
        """Emits the held tokens' text, ``text`` being the window's decode; they become the anchor."""
        held = self._window[self._num_anchor:]
        # The next anchor's text; one held token (the usual case) is memoized by the tokenizer.
        held_text = self._tokenizer.decode_token(held[0]) if len(held) == 1 else self._tokenizer.decode(held)
        if text.startswith(self._anchor_text):
            delta = text[len(self._anchor_text):]
        else:
            # A byte run spanning anchor and held tokens went invalid, so ByteFallback
            # rewrote the anchor's (already sent) text: the held tokens' text alone.
            delta = held_text
        # Characters of the held tokens already sent stay sent (even where a run went invalid since).
        delta = delta[len(self._sent):]
        self._window = held
        self._num_anchor = len(held)
        self._anchor_text = held_text
        self._sent, self._num_stalled = "", 0
        return delta
