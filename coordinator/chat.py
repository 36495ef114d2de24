"""Chat requests: messages rendered with the checkpoint's chat template, then tokenized.

The template is the checkpoint's own (``chat_template`` in ``tokenizer_config.json``, a
string or a list of named templates whose ``default`` is used, or a
``chat_template.jinja`` file beside it), rendered as ``transformers``'
``apply_chat_template`` renders it: a sandboxed Jinja environment
(``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter, ``raise_exception`` and
``strftime_now``), with ``messages``, ``add_generation_prompt=True`` and the special
tokens' strings (``bos_token``, ``eos_token``, ...).

Tokenizing: the rendered text contains control tokens written by the template
(``<s>``, ``[INST]``, ``<|im_start|>``) which must become those tokens, while text
inside a message is text: a user who writes ``</s>`` gets the characters, never the
eos token. When no message contains a special token's spelling, the whole rendered text
is encoded once with special tokens parsed, which is exactly what ``transformers``
does. Otherwise the text is cut at the messages' contents: template pieces are encoded
with special tokens parsed, contents literally (the token boundaries at the cuts can
then differ from a one-piece encoding; the special spelling stays text). Either way
the ids start with exactly one BOS when the tokenizer adds one. No torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from coordinator.errors import InvalidArgumentError

MAX_MESSAGES = 1024
MAX_ROLE_LEN = 64


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
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
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


def encode_chat(tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of a chat request: rendered, then tokenized as the module docstring says.

    Args:
        tokenizer: a :class:`coordinator.tokenizer.Tokenizer` with ``chat_template``.
        messages: ``{"role": ..., "content": ...}`` dicts.

    Raises:
        InvalidArgumentError: no template, no messages, too many, a bad role, or the
            template refuses them.
    """
    if tokenizer.chat_template is None:
        raise InvalidArgumentError("messages: the model has no chat template (chat_template in "
                                   "tokenizer_config.json or chat_template.jinja); send a text prompt")
    if not 1 <= len(messages) <= MAX_MESSAGES:
        raise InvalidArgumentError(f"messages has {len(messages)} entries; it must have 1 to {MAX_MESSAGES}")
    for index, message in enumerate(messages):
        if not 1 <= len(message["role"]) <= MAX_ROLE_LEN:
            raise InvalidArgumentError(f"messages[{index}].role must be 1 to {MAX_ROLE_LEN} characters")
    text = render_chat(tokenizer.chat_template, messages, tokenizer.special_tokens_map)
    specials = tokenizer.added_token_texts
    if not any(s in message["content"] for message in messages for s in specials):
        return tokenizer.encode(text, parse_special_tokens=True)
    pieces: list[tuple[str, bool]] = []
    cursor = 0
    for message in messages:
        content = message["content"]
        if not content:
            continue
        if text.find(content, cursor) < 0:
            content = content.strip()  # templates often trim
        start = text.find(content, cursor)
        if start < 0:
            raise InvalidArgumentError(
                f"messages[{messages.index(message)}].content contains a special token's spelling and the chat "
                "template changes the content, so it cannot be kept as text")
        pieces += [(text[cursor:start], True), (content, False)]
        cursor = start + len(content)
    pieces.append((text[cursor:], True))
    return tokenizer.encode_pieces([p for p in pieces if p[0]])
