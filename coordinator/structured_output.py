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

Limits, each refused with INVALID_ARGUMENT naming the field and the limit (docs/design/sampling.md,
"Grammars compile in child processes"): the source's size, a schema's JSON nesting depth (checked here, before
llguidance sees it), llguidance's own parser limits, and the compile time: the grammar
is compiled in a child process (coordinator/grammar_compiler.py), never in a step.

A grammar request must end where its grammar ends (docs/design/sampling.md, "A grammar
request ends only where its grammar does"): stop strings, stop token ids, ``min_tokens`` and
``ignore_eos`` are refused with one, and
the ranks allow the model's eos only where the grammar accepts. No torch.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING

from coordinator.errors import InvalidArgumentError
from coordinator.grammar_compiler import GrammarCompiler, GrammarCompileTimeout, compile_format, count_accepted_tokens
from tpserve.v1 import generate_pb2 as pb

if TYPE_CHECKING:
    from coordinator.tokenizer import Tokenizer

MAX_FORMAT_BYTES = 64 * 1024
MAX_CHOICES = 256
#: Most nesting levels of objects and arrays in a schema's JSON (its root is level 1).
#: Real schemas stay under 20; llguidance's JSON parser stops at 128.
MAX_SCHEMA_DEPTH = 64


def grammar_for(response_format: pb.ResponseFormat, compiler: GrammarCompiler | None = None) -> str:
    """The llguidance grammar of a request's response_format ("" when unset).

    Args:
        response_format: the request's format.
        compiler: compiles in child processes under a time limit (the server's); None
            compiles on this thread without a time limit or a tokenizer (tests, tools).

    Raises:
        InvalidArgumentError: a malformed schema or regex, over a size, depth or
            compile-time limit, no or too many choices; the message names the field
            (``json_schema``, ``regex`` or ``choices``) and the limit or what llguidance said.
    """
    kind = response_format.WhichOneof("format")
    if kind is None:
        return ""
    field = f"sampling_params.response_format.{kind}"
    if kind == "choices":
        choices = tuple(response_format.choices.choices)
        if not 1 <= len(choices) <= MAX_CHOICES or not all(choices):
            raise InvalidArgumentError(f"{field} must have 1 to {MAX_CHOICES} non-empty strings")
        size = sum(len(choice.encode()) for choice in choices)
        source, compile_kind = "|".join(_escape(choice) for choice in choices), "regex"
    else:
        source = getattr(response_format, kind)
        size, compile_kind = len(source.encode()), kind
    if size > MAX_FORMAT_BYTES:
        raise InvalidArgumentError(f"{field} is {size} bytes; the limit is {MAX_FORMAT_BYTES}")
    if kind == "json_schema":
        source = _checked_schema(source, field)
    try:
        return compiler.compile(compile_kind, source) if compiler is not None else _compile(compile_kind, source)
    except GrammarCompileTimeout as exc:
        raise InvalidArgumentError(f"{field} took over the compile-time limit of {exc} of CPU time to compile") from None
    except ValueError as exc:
        raise InvalidArgumentError(f"{field} is not supported: {str(exc).strip()[:500]}") from None


def check_continuation(response_format: pb.ResponseFormat, grammar: str, token_ids: tuple[int, ...],
                       tokenizer: Tokenizer, vocab_size: int, compiler: GrammarCompiler | None = None) -> None:
    """Refuses a continuation (``generated_token_ids``) that the request's grammar does not allow.

    The server continues such a request as if it had produced those tokens itself; tokens
    that break the grammar would leave the ranks' matcher in error, and the request would
    "finish" at once with STOP, the server vouching for a document it did not produce
    (docs/design/cluster.md, "A continuation is checked like output"). A stream the server produced passes: its
    grammar allowed every token.

    Args:
        response_format: the request's format (names the field in the error).
        grammar: its llguidance grammar (:func:`grammar_for`).
        token_ids: the continuation, ids in [0, vocab_size).
        tokenizer: the model's tokenizer (used here when there is no ``compiler``).
        vocab_size: rows of the model's logits.
        compiler: checks in a child process under a time limit (the server's); None: on this thread.

    Raises:
        InvalidArgumentError: naming ``generated_token_ids``, the first token the grammar rejects
            and its position, or the time limit of the check.
    """
    field = f"sampling_params.response_format.{response_format.WhichOneof('format')}"
    try:
        if compiler is not None:
            num_accepted = compiler.count_accepted(grammar, list(token_ids))
        else:
            num_accepted = count_accepted_tokens(grammar, list(token_ids), _llg_tokenizer(tokenizer, vocab_size))
    except GrammarCompileTimeout as exc:
        raise InvalidArgumentError(f"generated_token_ids: checking its {len(token_ids)} tokens against {field} took "
                                   f"over the limit of {exc} of CPU time") from None
    if num_accepted < len(token_ids):
        raise InvalidArgumentError(
            f"generated_token_ids[{num_accepted}] (token {token_ids[num_accepted]}) breaks {field}: the grammar "
            f"rejects it after the {num_accepted} tokens before it; a continuation must be output the grammar allows")


@lru_cache(maxsize=4)
def _llg_tokenizer(tokenizer: Tokenizer, vocab_size: int):
    """The tokenizer as llguidance's (built once per tokenizer: about 10 ms on a 32k vocabulary)."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size)


def check_stop_conditions(params: pb.SamplingParams) -> None:
    """Refuses the stop conditions that would end a grammar request where its grammar does not.

    A stop string or stop token id could cut the output short (``{"name":" s`` reported
    as a complete stop); ``min_tokens`` would force tokens past the grammar's end and
    ``ignore_eos`` would keep sampling after it. vLLM accepts these and returns the
    broken output; we refuse them (the README's structured output section).

    Raises:
        InvalidArgumentError: naming the fields, when response_format is set with any of them.
    """
    if not params.HasField("response_format") or params.response_format.WhichOneof("format") is None:
        return
    conflicting = [name for name, on in [
        ("stop", bool(params.stop)), ("stop_token_ids", bool(params.stop_token_ids)),
        ("min_tokens", params.HasField("min_tokens") and params.min_tokens > 0), ("ignore_eos", params.ignore_eos),
    ] if on]
    if conflicting:
        names = ", ".join(f"sampling_params.{name}" for name in conflicting)
        raise InvalidArgumentError(f"{names} cannot be combined with sampling_params.response_format: the output "
                                   "ends exactly where its grammar is complete")


def _checked_schema(source: str, field: str) -> str:
    """The schema's JSON re-serialized compactly, after the depth limit."""
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"{field} is not valid JSON: {exc}") from None
    except RecursionError:  # Python's own parser gives up near 1000 levels
        raise InvalidArgumentError(f"{field} nests deeper than the limit of {MAX_SCHEMA_DEPTH} levels") from None
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidArgumentError(f"{field} nests {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}")
    return json.dumps(schema, separators=(",", ":"))


def _depth(value: object) -> int:
    """Nesting levels of dicts and lists (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


@lru_cache(maxsize=256)
def _compile(kind: str, source: str) -> str:
    return compile_format(kind, source)


def _escape(text: str) -> str:
    """``text`` as a regex that matches it literally (every character but letters and digits as ``\\x{..}``)."""
    return "(" + "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}" for c in text) + ")"
