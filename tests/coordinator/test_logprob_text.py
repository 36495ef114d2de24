"""A logprob's token text reads as it does inside a text (coordinator/logprobs.py, ``Tokenizer.token_text``).

Decoded alone, SentencePiece drops a token's leading space (``"▁there"`` read ``"there"``): a completion's
token texts then joined into ``",therewasalittlegirl"``, and distinct tokens (``"▁n"``, ``"n"``) read alike.
Checked on stories260k's SentencePiece tokenizer (byte fallback) against its goldens' texts, and on the
embedded model's tokenizer (ASCII: a multi-byte character split over tokens reads U+FFFD per part, as alone).
"""

from __future__ import annotations

import pytest

from coordinator.logprobs import token_logprob
from coordinator.tokenizer import Tokenizer
from tests.paths import load_goldens, requires_stories
from tpserve.step import SampleLogprobs


@requires_stories
def test_the_goldens_token_texts_join_into_their_texts(stories_tokenizer: Tokenizer) -> None:
    for golden in load_goldens():
        prompt, completion = golden["prompt_token_ids"], golden["completion_token_ids"]
        text = stories_tokenizer.decode(prompt + completion)[len(stories_tokenizer.decode(prompt)):]
        assert "".join(map(stories_tokenizer.token_text, completion)) == text
        assert "".join(stories_tokenizer.decode_token(t) for t in completion) != text  # what decoding alone gave


@requires_stories
def test_tokens_that_read_alike_alone_differ_in_their_spaces(stories_tokenizer: Tokenizer) -> None:
    there, n_word, n_piece = (stories_tokenizer._backend.token_to_id(piece) for piece in ("▁there", "▁n", "n"))
    assert stories_tokenizer.token_text(there) == " there" and stories_tokenizer.decode_token(there) == "there"
    assert (stories_tokenizer.token_text(n_word), stories_tokenizer.token_text(n_piece)) == (" n", "n")
    assert stories_tokenizer.token_text(2) == "</s>"  # special tokens keep their text
    byte = stories_tokenizer._backend.token_to_id("<0xE2>")
    assert stories_tokenizer.token_text(byte) == "\ufffd"  # part of a character, as alone
    sample = SampleLogprobs(0, -0.1, (there, n_word), (-0.1, -2.5))
    lp = token_logprob(stories_tokenizer, there, sample)
    assert (lp.text, [top.text for top in lp.top_logprobs]) == (" there", [" there", " n"])


@pytest.mark.parametrize("text", ["Once upon a time, there was a girl.", "  two spaces\nand a line", "tabs\tand punctuation: (yes!)"])
def test_the_embedded_tokenizers_token_texts_join_into_the_text(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode("Hello" + text)[len(tokenizer.encode("Hello")):]
    want = tokenizer.decode(tokenizer.encode("Hello") + ids)[len(tokenizer.decode(tokenizer.encode("Hello"))):]
    assert "".join(map(tokenizer.token_text, ids)) == want
