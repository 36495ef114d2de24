"""A request's ``response_format`` as an llguidance grammar, validated at the edge.

llguidance (rather than xgrammar) because it is a small self-contained wheel with no
torch or CUDA dependency, so the torch-free coordinator can compile and validate a
schema itself and refuse a bad one with INVALID_ARGUMENT before anything is queued;
it computes a token mask on the CPU in tens of microseconds with no precomputation
per vocabulary, accepts JSON Schema, regular expressions and Lark grammars, and is one
of vLLM's structured-output backends. The worker side is worker/grammar.py.

- ``json_schema``: the schema's JSON text; the output is compact JSON (llguidance's
  ``whitespace_flexible: false``: no free whitespace, so a sampled token cannot spin
  on spaces);
- ``regex``: the whole output matches it (Rust ``regex`` syntax);
- ``choices``: the output is exactly one of the strings.

Grammars are cached by their source (an LRU of 256), so a schema sent with every
request is compiled and validated once. No torch.
"""

from __future__ import annotations

import json
from functools import lru_cache

from coordinator.errors import InvalidArgumentError
from tpserve.v1 import generate_pb2 as pb

MAX_FORMAT_BYTES = 64 * 1024
MAX_CHOICES = 256


def grammar_for(response_format: pb.ResponseFormat) -> str:
    """The llguidance grammar of a request's response_format ("" when unset).

    Raises:
        InvalidArgumentError: a malformed schema or regex, too large, no or too many
            choices; the message names the field and what llguidance said.
    """
    kind = response_format.WhichOneof("format")
    if kind is None:
        return ""
    if kind == "choices":
        choices = tuple(response_format.choices.choices)
        if not 1 <= len(choices) <= MAX_CHOICES or not all(choices):
            raise InvalidArgumentError(f"sampling_params.response_format.choices must have 1 to {MAX_CHOICES} "
                                       "non-empty strings")
        value = "|".join(_escape(choice) for choice in choices)
        kind = "regex"
    else:
        value = getattr(response_format, kind)
    if len(value.encode()) > MAX_FORMAT_BYTES:
        raise InvalidArgumentError(f"sampling_params.response_format.{kind} is over {MAX_FORMAT_BYTES} bytes")
    return _compile(kind, value)


@lru_cache(maxsize=256)
def _compile(kind: str, value: str) -> str:
    import llguidance

    field = f"sampling_params.response_format.{kind}"
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(f"{field} is not valid JSON: {exc}") from None
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                defaults={"whitespace_flexible": False})
    else:
        grammar = llguidance.LLMatcher.grammar_from_regex(value)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidArgumentError(f"{field} is not supported: {error.strip()[:500]}")
    return grammar


def _escape(text: str) -> str:
    """``text`` as a regex that matches it literally (every character but letters and digits as ``\\x{..}``)."""
    return "(" + "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}" for c in text) + ")"
