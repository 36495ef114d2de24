"""Structured output at the coordinator: bounded compiles and stop conditions (docs/design/sampling.md, "Structured
output").

Real requests through ``validate_request`` with the embedded model's tokenizer; the
compile-time limit runs a real :class:`GrammarCompiler` (child processes) on a schema
that llguidance takes about a second to build (an ``allOf`` of ``anyOf``s multiplies
out). Every refusal must be INVALID_ARGUMENT naming the field and the limit.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import pytest

from coordinator.errors import InvalidArgumentError, ResourceExhaustedError
from coordinator.grammar_compiler import GrammarCompiler
from coordinator.structured_output import MAX_FORMAT_BYTES, MAX_SCHEMA_DEPTH
from coordinator.tokenizer import Tokenizer
from coordinator.validation import validate_request
from tests.coordinator.costly_schemas import deep_any_of
from tpserve.embedded_model import default_model_dir
from tpserve.v1 import generate_pb2 as pb

VOCAB_SIZE, MAX_MODEL_LEN = 1024, 512
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
          "additionalProperties": False}


def three_way_all_of(num: int) -> dict:
    """``allOf`` of ``num`` three-way ``anyOf``s: 3**num alternatives. At 7, about 0.6 s to build on a quiet host,
    below llguidance's grammar-size limit: slow, yet not refused by llguidance itself."""
    return {"allOf": [{"anyOf": [
        {"type": "object", "properties": {f"p{i}_{j}": {"type": "integer"}}, "required": [f"p{i}_{j}"]}
        for j in range(3)]} for i in range(num)]}


def request(response_format: pb.ResponseFormat, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 5, 6]),
                              sampling_params=pb.SamplingParams(response_format=response_format, **sampling))


def refusal(tokenizer: Tokenizer, msg: pb.GenerateRequest, **kwargs) -> str:
    with pytest.raises(InvalidArgumentError) as info:
        validate_request(msg, tokenizer, VOCAB_SIZE, MAX_MODEL_LEN, **kwargs)
    return str(info.value)


# -- fault 3: limits on depth, size and compile time -----------------------------------------


@pytest.mark.parametrize("depth", [35, 200])
def test_a_deep_schema_is_refused_naming_the_depth_limit(tokenizer: Tokenizer, depth: int) -> None:
    """Was ``ValueError: recursion limit exceeded`` (INTERNAL) from llguidance's JSON parser."""
    message = refusal(tokenizer, request(pb.ResponseFormat(json_schema=json.dumps(deep_any_of(depth)))))
    assert message == (f"sampling_params.response_format.json_schema nests {4 * depth + 1} levels deep; "
                       f"the limit is {MAX_SCHEMA_DEPTH}")


def test_json_nested_past_pythons_parser_is_refused_naming_the_depth_limit(tokenizer: Tokenizer) -> None:
    message = refusal(tokenizer, request(pb.ResponseFormat(json_schema="[" * 5000 + "]" * 5000)))
    assert message == f"sampling_params.response_format.json_schema nests deeper than the limit of {MAX_SCHEMA_DEPTH} levels"


def test_a_schema_within_the_depth_limit_compiles(tokenizer: Tokenizer) -> None:
    params = validate_request(request(pb.ResponseFormat(json_schema=json.dumps(deep_any_of(15)))), tokenizer,
                              VOCAB_SIZE, MAX_MODEL_LEN)
    assert params.sampling.grammar and '"anyOf"' in params.sampling.grammar


def test_choices_over_the_size_limit_are_refused_naming_choices(tokenizer: Tokenizer) -> None:
    """Was refused naming ``regex`` (the choices' internal form)."""
    choices = pb.Choices(choices=[f"{i:03d}" + "x" * 297 for i in range(256)])  # 256 x 300 bytes
    message = refusal(tokenizer, request(pb.ResponseFormat(choices=choices)))
    assert message == f"sampling_params.response_format.choices is 76800 bytes; the limit is {MAX_FORMAT_BYTES}"


@pytest.fixture(scope="module")
def compiler() -> Iterator[GrammarCompiler]:
    # Wall time up to 40 limits: the limit is CPU time, and a loaded test host may give the niced child little of it.
    grammars = GrammarCompiler(default_model_dir(), VOCAB_SIZE, timeout_s=0.25, num_processes=1, wall_factor=40)
    yield grammars
    grammars.close()


def test_a_slow_schema_is_refused_at_the_compile_time_limit_and_the_compiler_recovers(
        tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    # The child's start-up (its tokenizer) is not part of the limit: warm it first.
    ok = validate_request(request(pb.ResponseFormat(json_schema=json.dumps(SCHEMA))), tokenizer, VOCAB_SIZE,
                          MAX_MODEL_LEN, grammars=compiler)
    assert '"name"' in ok.sampling.grammar
    # About 0.6 s on a quiet host, 2.5 times the limit: multiplying_all_of(10), at 0.25 s, sat on the limit and
    # compiled in time on a quiet CI host.
    slow = request(pb.ResponseFormat(json_schema=json.dumps(three_way_all_of(7))))
    child = compiler._idle.queue[0]
    message = refusal(tokenizer, slow, grammars=compiler)
    assert message == ("sampling_params.response_format.json_schema took over the compile-time limit of 0.25 s of "
                       "CPU time to compile")
    assert child.process.poll() is not None  # killed: the work cannot be interrupted
    # The stuck child was killed and replaced: the next schema compiles (same grammar as before).
    again = validate_request(request(pb.ResponseFormat(regex="[a-z]{3}")), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN,
                             grammars=compiler)
    assert "[a-z]{3}" in again.sampling.grammar


def test_the_child_refuses_what_llguidance_refuses_naming_the_field(tokenizer: Tokenizer,
                                                                    compiler: GrammarCompiler) -> None:
    message = refusal(tokenizer, request(pb.ResponseFormat(regex="(a")), grammars=compiler)
    assert message.startswith("sampling_params.response_format.regex is not supported:") and "unclosed group" in message
    message = refusal(tokenizer, request(pb.ResponseFormat(json_schema='{"type": "objectx"}')), grammars=compiler)
    assert message.startswith("sampling_params.response_format.json_schema is not supported:")


def test_a_compile_the_host_starves_is_refused_as_retryable_not_invalid(tokenizer: Tokenizer) -> None:
    """The limit is the child's CPU time: a regex compiling in 0.5 s alone was refused INVALID_ARGUMENT (a permanent
    error) under 48 streams' load, when the limit was wall time, and accepted alone again. A child that gets no
    CPU at all (SIGSTOP here: a saturated host) is ended after ``wall_factor`` limits with RESOURCE_EXHAUSTED."""
    grammars = GrammarCompiler(default_model_dir(), VOCAB_SIZE, timeout_s=0.5, num_processes=1, wall_factor=3)
    try:
        validate_request(request(pb.ResponseFormat(regex="[a-z]{3}")), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN,
                         grammars=grammars)  # its child is up
        child = grammars._idle.queue[0]
        os.kill(child.process.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(ResourceExhaustedError) as info:
            validate_request(request(pb.ResponseFormat(regex="[a-z]{4}")), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN,
                             grammars=grammars)
        elapsed = time.monotonic() - start
        assert str(info.value) == "the host was too busy to build the grammar (its limit: 0.5 s of CPU time); retry"
        assert 1.4 < elapsed < 4.0, elapsed  # three limits of wall time
        assert child.process.poll() is not None  # killed and replaced: the same request compiles now
        again = validate_request(request(pb.ResponseFormat(regex="[a-z]{4}")), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN,
                                 grammars=grammars)
        assert "[a-z]{4}" in again.sampling.grammar
    finally:
        grammars.close()


@pytest.mark.parametrize(("response_format", "field", "reason"), [
    (pb.ResponseFormat(regex=r"[^\s\S]"), "regex", "it accepts no text at all"),
    (pb.ResponseFormat(json_schema='{"$ref": "#"}'), "json_schema", "it accepts no text at all"),  # only recursion
    # "</s>" is the eos token's text: no ordinary token spells it (the probe's outputs were token 0, <unk>)
    (pb.ResponseFormat(regex="</s>"), "regex", "no token of the model's vocabulary can start text"),
    (pb.ResponseFormat(choices=pb.Choices(choices=["</s>"])), "choices", "no token of the model's vocabulary"),
], ids=["empty-regex", "recursive-schema", "special-token-text", "special-token-choice"])
def test_a_format_no_token_can_start_is_refused_naming_the_field(
        tokenizer: Tokenizer, compiler: GrammarCompiler, response_format: pb.ResponseFormat, field: str,
        reason: str) -> None:
    """These used to be accepted, and the sampler's argmax over an all ``-inf`` mask returned token 0 as a
    complete (``stop``) output. The compile child now computes the first mask too (tpserve/llguidance_setup.py)."""
    message = refusal(tokenizer, request(response_format), grammars=compiler)
    assert message.startswith(f"sampling_params.response_format.{field} is not supported: {reason}"), message


# -- faults 5 and 6: a grammar ends only where it is complete --------------------------------


@pytest.mark.parametrize(("sampling", "fields"), [
    (dict(stop=["ai"]), "sampling_params.stop"),
    (dict(stop_token_ids=[5]), "sampling_params.stop_token_ids"),
    (dict(min_tokens=5, max_tokens=8), "sampling_params.min_tokens"),
    (dict(ignore_eos=True), "sampling_params.ignore_eos"),
    (dict(stop=["x"], ignore_eos=True), "sampling_params.stop, sampling_params.ignore_eos"),
])
@pytest.mark.parametrize("response_format", [
    pb.ResponseFormat(json_schema=json.dumps(SCHEMA)), pb.ResponseFormat(regex="[a-z]{3}"),
    pb.ResponseFormat(choices=pb.Choices(choices=["yes", "no"]))], ids=["json_schema", "regex", "choices"])
def test_stop_conditions_with_a_grammar_are_refused_naming_the_fields(
        tokenizer: Tokenizer, response_format: pb.ResponseFormat, sampling: dict, fields: str) -> None:
    message = refusal(tokenizer, request(response_format, **sampling))
    assert message == (f"{fields} cannot be combined with sampling_params.response_format: "
                       "the output ends exactly where its grammar is complete")


def test_a_grammar_request_sends_the_eos_ids_the_ranks_allow_only_where_it_accepts(tokenizer: Tokenizer) -> None:
    params = validate_request(request(pb.ResponseFormat(regex="[a-z]{3}")), tokenizer, VOCAB_SIZE,
                              MAX_MODEL_LEN)
    assert params.sampling.grammar_stop_ids == tuple(sorted(tokenizer.eos_token_ids)) != ()
    plain = validate_request(request(pb.ResponseFormat()), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN)
    assert plain.sampling.grammar == "" and plain.sampling.grammar_stop_ids == ()
