"""Building a GenerateRequest from Python values: :func:`build_request`, whose keywords are the
sampling table's (tpserve/sampling_fields.py) and a few more, and :func:`request_keywords`, which gives a
client method the same keywords (for ``help()`` and ``inspect.signature``)."""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

from tpserve.sampling_fields import FIELDS, SamplingField
from tpserve.v1 import generate_pb2 as pb

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]


def _annotation(spec: SamplingField) -> object:
    """The client keyword's type: an unset scalar is None (the server's default)."""
    if spec.type is list:
        return str | Sequence[str] if spec.items is str else Sequence[spec.items]
    if spec.type is dict:
        return Mapping[spec.items[0], spec.items[1]] | None
    return bool if spec.type is bool else spec.type | None


def _entries(value: object) -> Sequence:
    """A list keyword's entries: a ``str`` is one entry (``stop="###"``), None none."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else value  # type: ignore[return-value]


def _client_default(spec: SamplingField) -> object:
    return {list: (), dict: None, bool: False}.get(spec.type)


#: build_request's keywords: every field of the sampling table (tpserve/sampling_fields.py), then the rest.
_REQUEST_KEYWORDS = [inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, default=_client_default(spec),
                                       annotation=_annotation(spec)) for spec in FIELDS] + [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
    for name, annotation, default in (
        ("json_schema", str | Mapping | None, None), ("regex", str | None, None),
        ("choices", str | Sequence[str] | None, None), ("cache_salt", str | None, None), ("priority", int, 0),
        ("lora_name", str | None, None), ("parse_special_tokens", bool, False),
        ("request_id", str, ""))]
_PROMPT = inspect.Parameter("prompt", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Prompt)
_KEYWORD_DOCS = "\n".join(f"    {spec.name}: {spec.help}" for spec in FIELDS)


def request_keywords(function):
    """Gives ``function(self?, prompt, *, timeout_s?, **fields)`` the signature of :func:`build_request`'s
    keywords (shown by ``help()`` and ``inspect.signature``) and their meanings in its docstring."""
    signature = inspect.signature(function)
    head = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    tail = [p for p in head if p.kind is inspect.Parameter.KEYWORD_ONLY]  # timeout_s
    head = [p for p in head if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    function.__signature__ = signature.replace(parameters=[*head, *_REQUEST_KEYWORDS, *tail])
    doc = (function.__doc__ or "").rstrip()
    indent = " " * min((len(line) - len(line.lstrip()) for line in doc.splitlines()[1:] if line.strip()), default=4)
    function.__doc__ = f"{doc}\n\n{indent}Sampling keywords (None: the server's default):\n" + \
        "\n".join(indent + line for line in _KEYWORD_DOCS.splitlines()) + "\n"
    return function


@request_keywords
def build_request(prompt: Prompt, **fields) -> pb.GenerateRequest:
    """A GenerateRequest from Python values; None leaves a field unset (the server's default).

    A ``str`` given for a list of strings (``stop``, ``choices``) is one entry, as OpenAI's ``stop``
    takes it (not its characters). A ``str`` prompt is sent as text, a sequence of ints as token ids, a sequence of
    ``{"role": ..., "content": ...}`` mappings as chat messages (rendered with the
    model's chat template). ``cache_salt`` keeps the request's prefix-cache entries apart
    from those of requests without the same salt. ``lora_name`` generates with that LoRA
    adapter of the server's ``--lora-modules`` (None: the base model). ``parse_special_tokens`` makes
    special-token spellings in a text prompt (``</s>``) their tokens, not literal text. A boolean field given
    anything but a ``bool`` is refused (vLLM's ``logprobs=5`` means top 5; here it read as True). The fields'
    meanings and ranges: proto/tpserve/v1/generate.proto.

    Raises:
        ValueError: more than one of ``json_schema``, ``regex`` and ``choices``; a keyword or the prompt that
            protobuf cannot hold (a wrong type, out of range, a chat message without "content"), naming it.
        TypeError: an unknown keyword.
    """
    bound = build_request.__signature__.bind(prompt, **fields)
    bound.apply_defaults()
    values = bound.arguments
    params = pb.SamplingParams()
    for spec in FIELDS:
        value = values[spec.name]
        if spec.type is bool and value is not None and not isinstance(value, bool):  # protobuf takes any int
            hint = "; top_logprobs=N asks for the N most likely tokens" if spec.name == "logprobs" else ""
            raise ValueError(f"{spec.name} must be True or False, got {value!r}{hint}")
        try:
            if spec.type is list:
                getattr(params, spec.name).extend(_entries(value))  # None leaves it unset, as for the others
            elif spec.type is dict:
                getattr(params, spec.name).update(dict(value or {}))
            elif value is not None:
                setattr(params, spec.name, value)
        except (ValueError, TypeError) as exc:  # protobuf's "Value out of range: 10000000000" names no field
            raise ValueError(f"{spec.name}: {exc}") from None
    json_schema, regex, choices = values["json_schema"], values["regex"], values["choices"]
    constraints = [name for name, value in (("json_schema", json_schema), ("regex", regex), ("choices", choices))
                   if value is not None]
    if len(constraints) > 1:
        raise ValueError(f"{' and '.join(constraints)} both constrain the output; give one of json_schema, regex "
                         "and choices")
    if json_schema is not None:  # structured output: at most one of the three
        params.response_format.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    elif regex is not None:
        params.response_format.regex = regex
    elif choices is not None:
        params.response_format.choices.choices.extend(_entries(choices))
    request = pb.GenerateRequest(sampling_params=params)
    if not isinstance(values["parse_special_tokens"], bool):
        raise ValueError(f"parse_special_tokens must be True or False, got {values['parse_special_tokens']!r}")
    request.parse_special_tokens = values["parse_special_tokens"]
    for name in ("request_id", "priority", "cache_salt", "lora_name"):
        if values[name] is not None:  # None: unset, as for the sampling fields
            _set_field(request, name, values[name])
    _set_prompt(request, prompt)
    return request


def _set_field(message: Any, name: str, value: object) -> None:
    """``message.<name> = value``.

    Raises:
        ValueError: protobuf cannot hold ``value`` there (a wrong type, out of range), naming the keyword:
            protobuf's own ``'str' object cannot be interpreted as an integer`` names none.
    """
    try:
        setattr(message, name, value)
    except TypeError:  # protobuf says "bad argument type for built-in operation"
        expected = "a str" if message.DESCRIPTOR.fields_by_name[name].type == FieldDescriptor.TYPE_STRING else "an int"
        raise ValueError(f"{name} must be {expected}, got {type(value).__name__}") from None
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _set_prompt(request: pb.GenerateRequest, prompt: Prompt) -> None:
    """Sets the request's text, chat messages or token ids from ``prompt``.

    Raises:
        ValueError: ``prompt`` is none of the three, or holds what protobuf cannot (a message without
            "content", a token id that is not an int32), naming the prompt and the message's index.
    """
    if isinstance(prompt, str):
        request.text = prompt
        return
    try:
        items = list(prompt)
    except TypeError:
        raise ValueError(f"prompt must be text, token ids or chat messages, got {type(prompt).__name__}") from None
    if items and isinstance(items[0], Mapping):
        request.messages.messages.extend(_chat_message(index, item) for index, item in enumerate(items))
        return
    request.token_ids.SetInParent()  # an empty list is still a (bad) token-id prompt
    try:
        request.token_ids.ids.extend(items)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"prompt: token ids must be int32 values ({exc})") from None


def _chat_message(index: int, message: object) -> pb.ChatMessage:
    """``prompt[index]`` as a ChatMessage.

    Raises:
        ValueError: not a mapping with a "role" and a "content" string, naming ``prompt[index]`` (or the key).
    """
    if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
        raise ValueError(f'prompt[{index}]: a chat message is a mapping with "role" and "content", got {message!r:.80}')
    chat_message = pb.ChatMessage()
    try:
        for name in ("role", "content"):
            _set_field(chat_message, name, message[name])
    except ValueError as exc:  # "content must be a str, ...": which message's
        raise ValueError(f"prompt[{index}].{exc}") from None
    return chat_message

