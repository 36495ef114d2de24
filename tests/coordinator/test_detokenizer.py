"""IncrementalDetokenizer on the stories260k tokenizer (SentencePiece BPE, byte fallback, Strip decoder).

The reference is the goldens' definition of completion text:
``decode(prompt + completion)[len(decode(prompt)):]``, by our Tokenizer and by transformers.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from coordinator import detokenizer as detok_module
from coordinator.detokenizer import IncrementalDetokenizer
from coordinator.tokenizer import Tokenizer
from tests.paths import STORIES_DIR, load_goldens, requires_stories

pytestmark = requires_stories

BOS, EOS = 1, 2
TEXTS = [
    "café, niño, über",
    "日本語 and 中文",
    "emoji 🙂👍🏽 and a family 👨\u200d👩\u200d👧\u200d👦!",
    "mixed: é日🙂a ñ中👍🏽b",
    "🙂🙂🙂",
]
PROMPTS = ["", "Once upon a time", "Lily saw 日本"]


def byte_token(value: int) -> int:
    """The byte-fallback token of one byte: <0x00> is id 3 in this vocabulary."""
    return 3 + value


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip(
        "transformers", reason="transformers is a test dependency (pip install -e '.[test]')")
    return transformers.AutoTokenizer.from_pretrained(STORIES_DIR)


def stream(stories_tokenizer: Tokenizer, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> tuple[list[str], str]:
    """The deltas of every step, and the flush."""
    detok = IncrementalDetokenizer(stories_tokenizer, prompt_ids)
    deltas = [detok.step(t) for t in completion_ids]
    return deltas, detok.flush()


def reference(decode, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> str:
    return decode(list(prompt_ids) + list(completion_ids))[len(decode(list(prompt_ids))):]


def hf_decoder(hf_tokenizer):
    return lambda ids: hf_tokenizer.decode(ids, skip_special_tokens=True)


def assert_clean(deltas: list[str]) -> None:
    for delta in deltas:
        assert "\ufffd" not in delta, deltas
        delta.encode("utf-8")  # raises UnicodeEncodeError on a lone surrogate


@pytest.mark.parametrize("golden", load_goldens(), ids=lambda g: g["prompt"])
def test_golden_completions(stories_tokenizer: Tokenizer, hf_tokenizer, golden: dict) -> None:
    prompt_ids, completion_ids = golden["prompt_token_ids"], golden["completion_token_ids"]
    deltas, tail = stream(stories_tokenizer, prompt_ids, completion_ids)
    assert "".join(deltas) + tail == golden["text"]
    assert tail == ""  # nothing held at the end of plain text
    assert reference(hf_decoder(hf_tokenizer), prompt_ids, completion_ids) == golden["text"]
    # With eos appended (the engine does not feed it, but if it did it must add nothing).
    deltas, tail = stream(stories_tokenizer, prompt_ids, [*completion_ids, EOS])
    assert deltas[-1] == "" and "".join(deltas) + tail == golden["text"]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("text", TEXTS)
def test_unicode_streams_never_emit_broken_characters(stories_tokenizer: Tokenizer, hf_tokenizer, prompt: str,
                                                      text: str) -> None:
    prompt_ids = stories_tokenizer.encode(prompt)
    completion_ids = stories_tokenizer.encode(text)[1:]  # without bos; starts with "▁": a space after a prompt
    deltas, tail = stream(stories_tokenizer, prompt_ids, completion_ids)
    assert_clean(deltas)
    assert tail == ""
    # A bos-only prompt decodes to "", so the decoder strips the completion's leading space.
    expected = text if prompt == "" else " " + text
    assert "".join(deltas) == expected
    assert "".join(deltas) == reference(hf_decoder(hf_tokenizer), prompt_ids, completion_ids)


@pytest.mark.parametrize("text", TEXTS)
def test_every_prompt_split_at_a_character_boundary(stories_tokenizer: Tokenizer, text: str) -> None:
    # Splitting one encoding anywhere makes prompts that end in, or whose last few
    # tokens start inside, a run of byte tokens: the first anchor must not start mid-character.
    ids = stories_tokenizer.encode("Start " + text + " end")
    num_checked = 0
    for k in range(1, len(ids)):
        prompt_ids, completion_ids = ids[:k], ids[k:]
        if stories_tokenizer.decode(prompt_ids).endswith("\ufffd"):
            continue  # the prompt ends inside a character: no boundary convention holds
        deltas, tail = stream(stories_tokenizer, prompt_ids, completion_ids)
        assert_clean(deltas)
        assert "".join(deltas) + tail == reference(stories_tokenizer.decode, prompt_ids, completion_ids), k
        num_checked += 1
    assert num_checked > len(text) // 2


def test_multibyte_character_is_held_until_complete(stories_tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(stories_tokenizer, stories_tokenizer.encode("Hi"))
    assert detok.step(410) == " "  # "▁"
    assert [detok.step(byte_token(b)) for b in "日".encode()] == ["", "", "日"]
    assert detok.num_held_tokens == 0
    assert [detok.step(byte_token(b)) for b in "🙂".encode()[:3]] == ["", "", ""]
    assert detok.num_held_tokens == 3
    assert detok.step(byte_token("🙂".encode()[3])) == "🙂"


def test_truncated_bytes_flush_as_replacement_characters(stories_tokenizer: Tokenizer) -> None:
    prompt_ids = stories_tokenizer.encode("ab")
    truncated = [byte_token(b) for b in "本".encode()[:2]]
    deltas, tail = stream(stories_tokenizer, prompt_ids, truncated)
    assert deltas == ["", ""]
    assert tail == "\ufffd\ufffd"  # one per byte, as a full decode gives
    assert "".join(deltas) + tail == reference(stories_tokenizer.decode, prompt_ids, truncated)


def test_truncated_bytes_after_a_complete_character_keep_that_character(stories_tokenizer: Tokenizer) -> None:
    # A full decode turns the whole byte run (日 + 2 bytes) into 5 U+FFFD; text already
    # streamed cannot be taken back, so only the truncated bytes become U+FFFD.
    completion = [byte_token(b) for b in "日".encode() + "本".encode()[:2]]
    deltas, tail = stream(stories_tokenizer, stories_tokenizer.encode("ab"), completion)
    assert deltas == ["", "", "日", "", ""]
    assert tail == "\ufffd\ufffd"


def test_stray_byte_releases_after_bounded_wait(stories_tokenizer: Tokenizer) -> None:
    # A continuation byte on its own makes the byte run invalid however long it grows:
    # the detokenizer stops waiting after _MAX_HELD_TOKENS and emits U+FFFD, as a full decode does.
    max_held = detok_module._MAX_HELD_TOKENS
    prompt_ids = stories_tokenizer.encode("ab")
    detok = IncrementalDetokenizer(stories_tokenizer, prompt_ids)
    stray_run = [byte_token(0x97)] + [byte_token(b) for b in "日本語".encode()]  # 10 byte tokens
    deltas, num_held = [], []
    for token in stray_run:
        deltas.append(detok.step(token))
        num_held.append(detok.num_held_tokens)
    assert deltas == [""] * (max_held - 1) + ["\ufffd" * max_held] + [""] * (len(stray_run) - max_held)
    assert max(num_held) == max_held - 1
    assert detok.step(403) == "\ufffd" * (len(stray_run) - max_held) + " Once"
    assert detok.flush() == ""
    assert "".join(deltas) + "\ufffd" * 2 + " Once" == reference(stories_tokenizer.decode, prompt_ids, [*stray_run, 403])


def test_special_tokens_produce_no_text_and_keep_spacing(stories_tokenizer: Tokenizer) -> None:
    once, upon = stories_tokenizer.encode("Once upon")[1:]
    detok = IncrementalDetokenizer(stories_tokenizer, [BOS])
    # bos-only prompt: "Once" starts the text, so no space; eos (ignore_eos) and bos add nothing.
    assert [detok.step(t) for t in (once, EOS, BOS, upon, 0)] == ["Once", "", "", " upon", ""]
    assert detok.flush() == ""


def test_empty_prompt_ids(stories_tokenizer: Tokenizer) -> None:
    once, upon = stories_tokenizer.encode("Once upon")[1:]
    deltas, tail = stream(stories_tokenizer, [], [once, upon])
    assert deltas == ["Once", " upon"] and tail == ""


def test_prompt_ending_inside_a_character(stories_tokenizer: Tokenizer) -> None:
    # Token-id prompts may end mid-character; the completion's continuation bytes are
    # not text on their own, so they come out as U+FFFD (no delta ends mid-character).
    first, *rest = (byte_token(b) for b in "日".encode())
    deltas, tail = stream(stories_tokenizer, [*stories_tokenizer.encode("x"), first], [*rest, 403])
    assert deltas == ["", "\ufffd\ufffd", " Once"] and tail == ""


class _CountingTokenizer(Tokenizer):
    """Records how many ids each decode call gets."""

    def __init__(self, inner: Tokenizer) -> None:
        self.__dict__.update(inner.__dict__)
        self.window_sizes: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.window_sizes.append(len(ids))
        return super().decode(ids, skip_special_tokens)


def test_cost_per_step_is_bounded_by_the_window(stories_tokenizer: Tokenizer) -> None:
    counting = _CountingTokenizer(stories_tokenizer)
    golden = load_goldens()[0]
    completion = golden["completion_token_ids"] * 40  # 2,560 tokens
    long_prompt = golden["prompt_token_ids"] + golden["completion_token_ids"] * 8
    detok = IncrementalDetokenizer(counting, long_prompt)
    text = "".join(detok.step(t) for t in completion) + detok.flush()
    assert text == reference(stories_tokenizer.decode, long_prompt, completion)
    # Each step decodes the anchor (the last emission) plus held tokens: a few ids, never O(length).
    assert max(counting.window_sizes) <= 2 * detok_module._MAX_HELD_TOKENS
    assert len(counting.window_sizes) <= 2 * len(completion) + 10


def test_a_memoized_token_text_is_the_token_decoded_alone(stories_tokenizer: Tokenizer) -> None:
    # decode_token is what the detokenizer's anchors and every logprob's text use: for every id
    # of the vocabulary (bytes, specials, pieces), asked twice (the second from the memo).
    for skip_special_tokens in (True, False):
        for _ in range(2):
            assert [stories_tokenizer.decode_token(i, skip_special_tokens) for i in range(stories_tokenizer.vocab_size)] == \
                [stories_tokenizer.decode([i], skip_special_tokens) for i in range(stories_tokenizer.vocab_size)]


def _byte_level_tokenizer(directory, entries: list[bytes]) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2's byte-to-character map, ``ByteLevel`` decoder): the 256 bytes, then
    ``entries`` (ids 256 ...), then ``</s>``. No merges: it is decoded here, never trained or used to encode."""
    import json

    import tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    to_char = {b: chr(b if b in printable else next(extra)) for b in range(256)}  # GPT-2's bytes_to_unicode
    vocab = {to_char[b]: b for b in range(256)}
    for i, entry in enumerate(entries):
        vocab["".join(to_char[b] for b in entry)] = 256 + i
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, []))
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens([tokenizers.AddedToken("</s>", special=True)])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": None}))
    return Tokenizer.from_pretrained(directory)


def test_tokens_that_each_complete_one_character_and_start_the_next_stream_every_character(tmp_path) -> None:
    """A byte-level vocabulary can hold tokens that straddle characters (byte 4 of one emoji, bytes 1-3 of the
    next): twelve in a row leave every window ending inside a character. Each character goes out as it
    completes; the whole text is the full decode's (it went out as U+FFFD after 8 held tokens)."""
    emoji = [chr(0x1F600 + i).encode() for i in range(12)]
    entries = [emoji[0][:3], *(emoji[i - 1][3:] + emoji[i][:3] for i in range(1, 12)), emoji[11][3:] + b"!"]
    tokenizer = _byte_level_tokenizer(tmp_path, entries)
    ids = [256 + i for i in range(len(entries))]
    assert tokenizer.decode(ids) == "".join(e.decode() for e in emoji) + "!"
    detok = IncrementalDetokenizer(tokenizer, [ord("a")])
    deltas = [detok.step(t) for t in ids]
    assert deltas == ["", *(e.decode() for e in emoji[:-1]), emoji[-1].decode() + "!"] and detok.flush() == ""
    # An invalid run still goes out after the bounded wait: stray continuation bytes complete nothing.
    stray = IncrementalDetokenizer(tokenizer, [ord("a")])
    out = [stray.step(0x80) for _ in range(detok_module._MAX_HELD_TOKENS + 1)]
    assert out == [""] * (detok_module._MAX_HELD_TOKENS - 1) + ["\ufffd" * detok_module._MAX_HELD_TOKENS, ""]
