"""Train the byte-fallback BPE tokenizer of tpserve's default model.

SentencePiece/Llama layout, like ``shared/models/stories260k/tokenizer.json``:

* ids 0, 1, 2 are ``<unk>``, ``<s>``, ``</s>``; ids 3..258 are the 256 byte
  tokens ``<0x00>``..``<0xFF>``, so any UTF-8 text is encodable (byte fallback);
  the BPE characters and merges learned from the corpus follow;
* normalizer: prepend "▁" and replace every space by "▁"; pre-tokenizer: split
  before each "▁" (merges never cross words) and isolate ``. , ! ? ; :`` (so
  "park." and "park," share the token "▁park"); decoder: "▁" -> space, fuse
  the byte tokens back into characters, strip the one space the normalizer
  added. ``decode(encode(text)) == text`` for any text without a literal "▁";
* the post-processor puts ``<s>`` in front (``encode(text).ids[0] == 1``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

SPECIALS = ["<unk>", "<s>", "</s>"]
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(256)]


def _pipeline(tok: Tokenizer) -> Tokenizer:
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True),
        pre_tokenizers.Split(Regex(r"[.,!?;:]"), "isolated"),
    ])
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """BPE on ``texts``; the result has exactly ``vocab_size`` tokens."""
    n_fixed = len(SPECIALS) + len(BYTE_TOKENS)
    probe = _pipeline(Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True)))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_fixed, special_tokens=[], show_progress=False)
    probe.train_from_iterator(texts, trainer)
    learned = json.loads(probe.to_str())["model"]
    # learned tokens in the trainer's order (alphabet first, then merges)
    order = sorted(learned["vocab"].items(), key=lambda kv: kv[1])
    vocab = {t: i for i, t in enumerate(SPECIALS + BYTE_TOKENS)}
    for t, _ in order:
        if t in vocab:  # cannot happen with the ASCII corpus, but stay exact
            raise ValueError(f"learned token {t!r} collides with a reserved token")
        vocab[t] = len(vocab)
    if len(vocab) != vocab_size:
        raise ValueError(f"tokenizer has {len(vocab)} tokens, wanted {vocab_size} (corpus too small?)")
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = _pipeline(Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                         byte_fallback=True, fuse_unk=True)))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", BOS_ID)])
    return tok


def tokenizer_config(max_len: int, chat_template: str | None = None) -> dict:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


ROUND_TRIP_TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "  two leading spaces, a tab\tand a newline\n, trailing space ",
    "Crème brûlée à la française, naïve café, Ærøskøbing, Straße",
    "日本語のテキスト、中文文本, 한국어 텍스트",
    "emoji: 🚀🙂👩‍👩‍👧 and symbols ∑ ≠ → ©",
    "",
]


def check_round_trip(tok: Tokenizer) -> None:
    for text in ROUND_TRIP_TEXTS:
        enc = tok.encode(text)
        assert enc.ids[0] == BOS_ID, enc.ids[:3]
        assert UNK_ID not in enc.ids, (text, enc.ids)
        back = tok.decode(enc.ids)
        assert back == text, (text, back)
