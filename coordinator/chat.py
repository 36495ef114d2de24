"""Chat requests: messages rendered with the checkpoint's chat template, then tokenized.

The template is the checkpoint's own (``chat_template`` in ``tokenizer_config.json``, a
string or a list of named templates whose ``default`` is used, or a
``chat_template.jinja`` file beside it), rendered as ``transformers``'
``apply_chat_template`` renders it: a sandboxed Jinja environment
(``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``, the
``loopcontrols`` extension and the ``{% generation %}`` tag, a ``tojson`` filter, ``raise_exception`` and
``strftime_now``), with ``messages``, ``add_generation_prompt=True`` and the special
tokens' strings (``bos_token``, ``eos_token``, ...). The server renders in a separate,
killable process with a time and memory limit (:mod:`coordinator.chat_renderer`).

No control token can come from a message (docs/design/request-path.md, "Chat"):

- a role is a role name (letters, digits, ``_``, ``-``, ``.``; no special token's
  spelling), since templates write it into the prompt as template text;
- the text of a message is text. When no content contains a special token's
  spelling, the rendered text is encoded once with special tokens parsed, which is
  exactly what ``transformers`` does. Otherwise (:class:`ChatPrompt`) every such
  spelling in a content is replaced, before rendering, by a sentinel the caller cannot
  guess (a per-request random number between private-use characters, which survive
  the string operations templates apply: strip, upper, concatenation, ``tojson``).
  The rendered text is then cut only at the special-token spellings left in it, which
  are the template's own: those become their tokens, and each text between them is
  encoded with the sentinels turned back into the user's spellings, literally (as
  characters). Token boundaries are those of ``transformers`` except at the start of
  such a text, where a tokenizer that prepends a space marker to the first word of an
  encoding may differ. Added tokens not flagged special (Qwen's ``<think>``) are
  ordinary vocabulary and encode as tokens anywhere, as in ``transformers`` and vLLM.

Either way the ids start with exactly one BOS when the tokenizer adds one. No torch.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from coordinator.errors import InvalidArgumentError

MAX_MESSAGES = 1024
MAX_ROLE_LEN = 64
#: Most bytes of UTF-8 in all contents together (the text prompt's limit).
MAX_CONTENT_BYTES = 1024**2
#: A role is a name such as user, assistant, system, tool, ipython: never markup, spaces or newlines.
_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")
# Sentinel delimiters: Supplementary Private Use Area-A, never changed by case or strip.
_OPEN, _MID, _CLOSE = "\U000F0000", "\U000F0001", "\U000F0002"


def read_chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The checkpoint's chat template source, or None when it has none.

    Raises:
        ValueError: ``chat_template`` is neither a string nor a list of named templates.
    """
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{model_dir / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                         f"named templates, got {type(template).__name__}")
    jinja_file = model_dir / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    return template


@lru_cache(maxsize=8)
def _compile(source: str):
    """The template compiled in transformers' sandboxed environment (cached per source)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body (transformers' ``AssistantTracker``
        marks where the assistant's tokens are, for training masks; serving needs the text alone)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, GenerationTag])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(template: str, messages: Sequence[dict[str, str]], special_tokens: dict[str, str]) -> str:
    """The prompt text of ``messages`` with ``add_generation_prompt=True``.

    Raises:
        InvalidArgumentError: the template refuses the messages (``raise_exception``,
            a role it does not know, an error while rendering), with its message.
    """
    import jinja2

    try:
        return _compile(template).render(messages=[dict(m) for m in messages], add_generation_prompt=True,
                                         tools=None, documents=None, **special_tokens)
    except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
        raise InvalidArgumentError(f"messages: the model's chat template refused them: {exc}") from None


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Checked messages, ready to render: each special token's spelling in a content is a sentinel.

    Attributes:
        messages: ``{"role", "content"}`` dicts to render (contents escaped).
        escaped: whether any content held a special token's spelling.
        nonce: this request's sentinel number (digits).
        specials: the special tokens' spellings; sentinel ``k`` stands for ``specials[k]``.
    """

    messages: list[dict[str, str]]
    escaped: bool
    nonce: str
    specials: tuple[str, ...]


def prepare_chat(tokenizer, messages: Sequence[dict[str, str]]) -> ChatPrompt:
    """Checks a conversation and escapes the special-token spellings of its contents.

    Args:
        tokenizer: a :class:`coordinator.tokenizer.Tokenizer`.
        messages: ``{"role": ..., "content": ...}`` dicts.

    Raises:
        InvalidArgumentError: no template, no messages or too many, contents over
            ``MAX_CONTENT_BYTES``, or ``messages[i].role`` is not a role name or spells a
            special token.
    """
    if tokenizer.chat_template is None:
        raise InvalidArgumentError("messages: the model has no chat template (chat_template in "
                                   "tokenizer_config.json or chat_template.jinja); send a text prompt")
    if not 1 <= len(messages) <= MAX_MESSAGES:
        raise InvalidArgumentError(f"messages has {len(messages)} entries; it must have 1 to {MAX_MESSAGES}")
    if sum(len(m["content"]) for m in messages) * 4 > MAX_CONTENT_BYTES and \
            sum(len(m["content"].encode()) for m in messages) > MAX_CONTENT_BYTES:
        raise InvalidArgumentError(f"messages' contents are over {MAX_CONTENT_BYTES} bytes of UTF-8")
    specials = tokenizer.special_token_texts
    for index, message in enumerate(messages):
        role = message["role"]
        if not 1 <= len(role) <= MAX_ROLE_LEN:
            raise InvalidArgumentError(f"messages[{index}].role must be 1 to {MAX_ROLE_LEN} characters")
        if not _ROLE.fullmatch(role) or any(s in role for s in specials):
            raise InvalidArgumentError(
                f"messages[{index}].role must be a role name (such as user, assistant, system or tool): a letter, "
                "then letters, digits, '_', '-' or '.', and no special token")
    pattern = _specials_pattern(specials)
    escaped = pattern is not None and any(pattern.search(m["content"]) for m in messages)
    if not escaped:
        return ChatPrompt([dict(role=m["role"], content=m["content"]) for m in messages], False, "", specials)
    nonce = str(secrets.randbelow(10**18)).zfill(18)
    index_of = {s: k for k, s in enumerate(specials)}

    def sentinel(match: re.Match) -> str:
        return f"{_OPEN}{nonce}{_MID}{index_of[match.group()]}{_CLOSE}"

    return ChatPrompt([dict(role=m["role"], content=pattern.sub(sentinel, m["content"])) for m in messages], True,
                      nonce, specials)


def tokenize_chat(tokenizer, prompt: ChatPrompt, text: str) -> list[int]:
    """Token ids of a rendered chat prompt, as the module docstring says.

    Args:
        tokenizer: the :class:`coordinator.tokenizer.Tokenizer` that prepared ``prompt``.
        prompt: from :func:`prepare_chat`.
        text: ``prompt.messages`` rendered with the chat template.
    """
    if not prompt.escaped:  # the template writes the special tokens: no post-processor's (an appended eos)
        return tokenizer.encode_pieces([(text, True)])
    sentinels = re.compile(re.escape(_OPEN + prompt.nonce + _MID) + r"(\d+)" + re.escape(_CLOSE))
    specials = prompt.specials

    def unescape(piece: str) -> str:
        return sentinels.sub(lambda m: specials[int(m.group(1))] if int(m.group(1)) < len(specials) else "", piece)

    pieces: list[tuple[str, bool]] = []
    cursor = 0
    for match in _specials_pattern(specials).finditer(text):  # the template's own: users' are sentinels here
        pieces += [(unescape(text[cursor:match.start()]), False), (match.group(), True)]
        cursor = match.end()
    pieces.append((unescape(text[cursor:]), False))
    return tokenizer.encode_pieces([p for p in pieces if p[0]])


def encode_chat(tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of a chat request, rendered in this process (tests, tools; the server renders
    in :class:`coordinator.chat_renderer.ChatRenderPool`, which bounds time and memory).

    Raises:
        InvalidArgumentError: as :func:`prepare_chat` and :func:`render_chat`.
    """
    prompt = prepare_chat(tokenizer, messages)
    return tokenize_chat(tokenizer, prompt, render_chat(tokenizer.chat_template, prompt.messages,
                                                        tokenizer.special_tokens_map))


@lru_cache(maxsize=8)
def _specials_pattern(specials: tuple[str, ...]) -> re.Pattern | None:
    """Finds special-token spellings leftmost first, the longest at a position (as ``tokenizers`` matches)."""
    if not specials:
        return None
    return re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
