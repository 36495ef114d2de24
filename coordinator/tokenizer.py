"""The model's tokenizer as the coordinator uses it: text to token ids and back, no torch.

Wraps a Hugging Face ``tokenizers.Tokenizer`` (the model directory's ``tokenizer.json``,
the pipeline ``transformers``' fast tokenizers run) and reads the settings that live
beside it:

- ``tokenizer_config.json`` (optional): ``bos_token``, ``eos_token`` (a string or an
  ``AddedToken`` dict with ``content``) and ``add_bos_token``;
- ``generation_config.json`` / ``config.json`` (optional): ``eos_token_id`` (an int or a
  list) and ``bos_token_id``.

Whether a bos token starts an encoded prompt is decided once, here: ``add_bos_token``
when the config says, else whatever ``tokenizer.json``'s post-processor does. The
post-processor is probed, so the bos is never added twice (post-processor and us).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from coordinator.chat import read_chat_template
from coordinator.tokenizer_post_processor import post_processor_tokens, with_special_tokens


#: Most token pairs :meth:`Tokenizer.decode_pair` remembers (about 150 bytes each).
PAIR_MEMO_SIZE = 1 << 16

class Tokenizer:
    """Encodes prompts and decodes completions for one model.

    Args:
        backend: the loaded ``tokenizers.Tokenizer``.
        bos_token_id: the beginning-of-sequence token, or None when the model has none.
        eos_token_ids: every token id that ends generation (may be empty).
        add_bos_token: whether ``encode`` starts with ``bos_token_id``; None follows the
            backend's post-processor.

    Raises:
        ValueError: ``add_bos_token`` is true but there is no bos token, or an id is
            outside the tokenizer's vocabulary.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Iterable[int], add_bos_token: bool | None = None) -> None:
        self._backend = backend
        # A copy that encodes special-token spellings as plain text (prompts are
        # literal by default); two objects, so no per-call flag is shared between threads.
        self._literal = tokenizers.Tokenizer.from_str(backend.to_str())
        self._literal.encode_special_tokens = True
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        eos_token_ids = frozenset(eos_token_ids)
        bad = sorted(i for i in {*eos_token_ids, bos_token_id} - {None} if not 0 <= i < self.vocab_size)
        if bad:
            raise ValueError(f"bos/eos token ids {bad} are outside the tokenizer's vocabulary [0, {self.vocab_size})")
        self.bos_token_id = bos_token_id
        self.eos_token_ids: frozenset[int] = eos_token_ids
        # Ids that decode(skip_special_tokens=True) drops: added tokens flagged special.
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        self._token_texts: dict[bool, dict[int, str]] = {True: {}, False: {}}  # decode_token's memo
        self._pair_texts: dict[tuple[int, int], str] = {}  # decode_pair's memo
        self._context_texts: dict[int, str] = {}  # token_text's memo
        self._anchor: tuple[int, str] | None = None  # token_text's anchor (:meth:`_text_anchor`)
        self._anchor_looked_up = False
        self._post_processor_first, self._post_processor_last = post_processor_tokens(backend)
        self._post_processor_adds_bos = bos_token_id is not None and self._post_processor_first == bos_token_id
        if add_bos_token is None:
            add_bos_token = self._post_processor_adds_bos
        if add_bos_token and bos_token_id is None:
            raise ValueError("add_bos_token is true but the tokenizer has no bos_token")
        self.add_bos_token: bool = add_bos_token
        # Chat (coordinator/chat.py): the template source, and the strings it may use.
        self.chat_template: str | None = None
        self.special_tokens_map: dict[str, str] = {}
        # Spellings of the control tokens (added tokens flagged special), which user text may
        # not turn into tokens; sorted, so that a chat prompt's sentinels name them stably.
        self.special_token_texts: tuple[str, ...] = tuple(sorted(
            {tok.content for tok in backend.get_added_tokens_decoder().values() if tok.special and tok.content}))

    def to_json(self) -> str:
        """The tokenizer's ``tokenizer.json`` text (llguidance builds its token table from it)."""
        return self._backend.to_str()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Loads ``tokenizer.json`` and the optional configs from a model directory.

        Raises:
            FileNotFoundError: the directory or its ``tokenizer.json`` is missing (a
                ``tokenizer.model``-only SentencePiece model must be converted first).
            ValueError: a config file is not valid JSON, or names an unknown token.
        """
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model directory {model_dir} does not exist")
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {model_dir}: tpserve needs a Hugging Face fast tokenizer "
                "file (convert a tokenizer.model with transformers' "
                "AutoTokenizer.from_pretrained(...).save_pretrained(...))")
        backend = tokenizers.Tokenizer.from_file(str(path))
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        gen_cfg = _read_json(model_dir / "generation_config.json")
        model_cfg = _read_json(model_dir / "config.json")

        def config_token_id(key: str) -> int | None:
            content = _token_content(tok_cfg.get(key))
            if content is None:
                return None
            found = backend.token_to_id(content)
            if found is None:
                raise ValueError(f"{model_dir / 'tokenizer_config.json'}: {key} {content!r} is not in the vocabulary")
            return found

        # tokenizer_config's bos_token wins ("bos_token": null means none); else the model configs.
        if "bos_token" in tok_cfg:
            bos_token_id = config_token_id("bos_token")
        else:
            bos_ids = _as_ids(gen_cfg.get("bos_token_id", model_cfg.get("bos_token_id")))
            bos_token_id = min(bos_ids) if bos_ids else None
        # generation_config overrides config.json for generation (as in transformers'
        # generate); the tokenizer's own eos is always a stop too (as in vLLM).
        eos_ids = _as_ids(gen_cfg.get("eos_token_id", model_cfg.get("eos_token_id")))
        tokenizer_eos = config_token_id("eos_token")
        if tokenizer_eos is not None:
            eos_ids.add(tokenizer_eos)
        add_bos = tok_cfg.get("add_bos_token")
        tokenizer = cls(backend, bos_token_id=bos_token_id, eos_token_ids=eos_ids,
                        add_bos_token=add_bos if isinstance(add_bos, bool) else None)
        tokenizer.chat_template = read_chat_template(model_dir, tok_cfg)
        tokenizer.special_tokens_map = {key: content for key in ("bos_token", "eos_token", "unk_token", "pad_token")
                                        if (content := _token_content(tok_cfg.get(key))) is not None}
        return tokenizer

    def encode(self, text: str, parse_special_tokens: bool = False) -> list[int]:
        """Token ids of a prompt, starting with exactly one bos when ``add_bos_token``.

        Args:
            text: the prompt.
            parse_special_tokens: encode special-token spellings in the text
                (``"</s>"``, ``"<unk>"``) as those tokens, as ``transformers`` does.
                False (the API's default): they are literal text, so user text cannot
                inject a control token. Either way, a text that begins with the bos
                token (a chat template's output, parsed) gets no second one.

        Releases the GIL while it tokenizes (``encode_batch`` does, ``encode`` does not),
        so a caller may run it on a thread next to an event loop: a 1 MB prompt takes
        about a second.
        """
        backend = self._backend if parse_special_tokens else self._literal
        ids = backend.encode_batch([text], add_special_tokens=True)[0].ids
        bos = self.bos_token_id
        if self._post_processor_adds_bos and not self.add_bos_token:
            ids = ids[1:]
        elif self.add_bos_token and not self._post_processor_adds_bos:
            ids = [bos, *ids]
        if self.add_bos_token and len(ids) >= 2 and ids[0] == ids[1] == bos:
            ids = ids[1:]
        return ids

    def encode_pieces(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        """Token ids of consecutive texts, each with or without special-token parsing (a chat
        prompt's template pieces and message contents), starting with exactly one bos when
        ``add_bos_token``."""
        ids: list[int] = []
        for text, parse_special_tokens in pieces:
            backend = self._backend if parse_special_tokens else self._literal
            ids += backend.encode_batch([text], add_special_tokens=False)[0].ids
        if self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids; special tokens (bos, eos) are dropped unless asked for.

        Ids outside the vocabulary decode to nothing (``tokenizers``' behaviour); the
        API edge rejects them before they get here.
        """
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """Text of one token decoded alone, as ``decode([token_id], ...)``; memoized, since it
        depends on the id only (the detokenizer's anchors and every logprob's text ask for the
        same ids again and again). At most one entry per vocabulary id and flag."""
        cache = self._token_texts[skip_special_tokens]
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = self._backend.decode([token_id], skip_special_tokens=skip_special_tokens)
        return text

    def token_text(self, token_id: int) -> str:
        """Text of one token as it reads after other text, special tokens kept (``"</s>"``): a logprob's text.

        ``decode([id])`` drops a leading space that SentencePiece's decoder strips from the first token
        (``"there"`` for ``"▁there"``), so two tokens could read alike and a sequence's token texts would not
        join into its text. Here the token follows an anchor, an ordinary token that reads as ``"a"``:
        ``decode([anchor, id])[len(decode([anchor])):]`` gives ``" there"``, as OpenAI's and vLLM's logprobs
        do. A byte of a multi-byte character reads U+FFFD, as alone. Memoized: one entry per id."""
        text = self._context_texts.get(token_id)
        if text is None:
            anchor = self._text_anchor()
            text = self.decode_token(token_id, skip_special_tokens=False)
            if anchor is not None:
                anchor_id, anchor_text = anchor
                both = self._backend.decode([anchor_id, token_id], skip_special_tokens=False)
                if both.startswith(anchor_text):  # else the two merged (never seen): the token alone
                    text = both[len(anchor_text):]
            self._context_texts[token_id] = text
        return text

    def _text_anchor(self) -> tuple[int, str] | None:
        """``(id, text)`` of the token ``"a"`` encodes to, when it is one token with that text; else None."""
        if not self._anchor_looked_up:
            ids = self._literal.encode("a", add_special_tokens=False).ids
            text = self.decode_token(ids[0], skip_special_tokens=False) if len(ids) == 1 else ""
            self._anchor = (ids[0], text) if text == "a" else None
            self._anchor_looked_up = True
        return self._anchor

    def decode_pair(self, first: int, second: int) -> str:
        """Text of two tokens, as ``decode([first, second])`` (special tokens dropped); memoized.

        The detokenizer's window in the steady state is one anchor token and one new token
        (coordinator/detokenizer.py): a pair seen before costs a dict look-up instead of a
        call into ``tokenizers`` (about 2-3 µs), once per streamed token (the per-token cost:
        docs/design/request-path.md,
        "Where a streamed token's coordinator CPU goes"). A decode depends on the ids only, so the memo is
        exact. It is bounded: full
        at :data:`PAIR_MEMO_SIZE` entries, it starts over (cheap; the frequent pairs return).
        """
        key = (first, second)
        text = self._pair_texts.get(key)
        if text is None:
            if len(self._pair_texts) >= PAIR_MEMO_SIZE:
                self._pair_texts.clear()
            text = self._pair_texts[key] = self._backend.decode([first, second], skip_special_tokens=True)
        return text

    def served_json(self) -> str | None:
        """The ``tokenizer.json`` a client that loads it alone (the gateway, by GetTokenizer) must get
        so that encoding with special tokens gives :meth:`encode`'s ids; None when the file itself does.

        The file's post-processor is rewritten (:func:`coordinator.tokenizer_post_processor.with_special_tokens`)
        only where it disagrees with ``add_bos_token`` (a ``tokenizer.json`` without one while
        tokenizer_config.json says ``add_bos_token: true``, or one adding the bos while the config says
        false); whatever it adds last (an eos) it keeps, as :meth:`encode` does. One difference is left: a
        text that begins with the bos spelling, parsed, gets one bos here and two from the file.
        """
        if self._post_processor_adds_bos == self.add_bos_token:
            return None
        return with_special_tokens(self._backend, bos_token_id=self.bos_token_id if self.add_bos_token else None,
                                   eos_token_id=self._post_processor_last).to_str()


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or ``{}`` when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _token_content(value: object) -> str | None:
    """A special token's text: configs write either ``"</s>"`` or ``{"content": "</s>", ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: object) -> set[int]:
    """``eos_token_id``-style values (None, an int or a list of ints) as a set of ids."""
    if value is None:
        return set()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"token ids must be integers, got {value!r}")
    return set(values)
