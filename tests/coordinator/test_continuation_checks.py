"""A continuation (``generated_token_ids``) is checked like output and counted as prompt
(docs/design/cluster.md, "A continuation is checked like output").

Forged tokens that break the request's grammar (regex, choices, JSON schema) are refused
with INVALID_ARGUMENT naming ``generated_token_ids`` and the first rejected token's
position, in the server's compile children and on the calling thread alike; the server
computes a continuation as a prompt, so usage and ``prompt_tokens_total`` count it as
prompt tokens and ``generation_tokens_total`` only the tokens it generated. On a real
model (a legitimate continuation gives the tail of the unmoved stream, and a forged one is
refused over gRPC): tests/cluster/test_stream_move.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import llguidance
import pytest

from coordinator.errors import InvalidArgumentError
from coordinator.grammar_compiler import GrammarCompiler
from coordinator.metrics import Metrics
from coordinator.tokenizer import Tokenizer
from coordinator.validation import validate_request
from tests.coordinator.fakes import FakeRankGroup, constant, make_engine
from tpserve.embedded_model import default_model_dir
from tpserve.v1 import generate_pb2 as pb

VOCAB_SIZE = 1024  # the embedded model's tokenizer
MAX_MODEL_LEN = 512
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
# Each format, a prefix of output it allows, and text it cannot continue that prefix with.
FORMATS = {
    "regex": (pb.ResponseFormat(regex="(yes|no)[0-9]+"), "yes12", "x"),
    "choices": (pb.ResponseFormat(choices=pb.Choices(choices=["alpha", "beta"])), "alp", "z"),
    "json_schema": (pb.ResponseFormat(json_schema=json.dumps(SCHEMA)), '{"name":"Tom","age":', '"x"'),
}


@pytest.fixture(scope="module")
def llg(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """Tokens as a grammar-constrained sampler produces them (no leading space, no BOS)."""
    return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=VOCAB_SIZE)


@pytest.fixture(scope="module")
def compiler() -> Iterator[GrammarCompiler]:
    grammars = GrammarCompiler(default_model_dir(), VOCAB_SIZE, num_processes=1)
    yield grammars
    grammars.close()


def _request(response_format: pb.ResponseFormat | None, generated: list[int], prompt=(1, 5),
             max_tokens: int = 40) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0)
    if response_format is not None:
        params.response_format.CopyFrom(response_format)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(prompt)), sampling_params=params,
                              generated_token_ids=generated)


@pytest.mark.parametrize("in_child", [False, True], ids=["this-thread", "compile-child"])
@pytest.mark.parametrize("kind", list(FORMATS))
def test_forged_tokens_that_break_the_grammar_are_invalid_argument(tokenizer, llg, compiler, kind, in_child) -> None:
    response_format, allowed, breaking = FORMATS[kind]
    grammars = compiler if in_child else None
    good = llg.tokenize_str(allowed)
    # What the grammar allows passes (a stream the server produced, cut anywhere).
    for k in range(1, len(good) + 1):
        params = validate_request(_request(response_format, good[:k]), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN,
                                  grammars=grammars)
        assert params.generated_token_ids == tuple(good[:k])
    forged = good + llg.tokenize_str(breaking)
    with pytest.raises(InvalidArgumentError) as info:
        validate_request(_request(response_format, forged), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN, grammars=grammars)
    assert str(info.value).startswith(
        f"generated_token_ids[{len(good)}] (token {forged[len(good)]}) breaks sampling_params.response_format.{kind}: "
        f"the grammar rejects it after the {len(good)} tokens before it")


def test_a_forged_first_token_is_refused_at_position_0(tokenizer, llg) -> None:
    response_format = FORMATS["json_schema"][0]
    story = tokenizer.encode("Once upon a time", parse_special_tokens=False)[1:]  # text, not JSON
    with pytest.raises(InvalidArgumentError, match=r"^generated_token_ids\[0\] \(token \d+\) breaks "
                                                   r"sampling_params.response_format.json_schema"):
        validate_request(_request(response_format, story), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN)


def _run(tokenizer: Tokenizer, request: pb.GenerateRequest) -> tuple[list, Metrics, FakeRankGroup]:
    metrics, group = Metrics(), FakeRankGroup(sample=constant(7))
    engine = make_engine(group=group, num_blocks=256, max_num_batched_tokens=1024, tokenizer=tokenizer,
                         max_model_len=MAX_MODEL_LEN, metrics=metrics)
    params = validate_request(request, tokenizer, VOCAB_SIZE, MAX_MODEL_LEN)

    async def main() -> list:
        loop = asyncio.create_task(engine.run())
        try:
            return [out async for out in engine.generate(params)]
        finally:
            loop.cancel()

    outputs = asyncio.run(main())
    assert engine.scheduler.allocator.num_free_blocks == 256
    return outputs, metrics, group


def test_forged_tokens_count_as_prompt_tokens_not_generated_ones(tokenizer) -> None:
    # A 2-token prompt and 400 given tokens, then 3 generated: the server computes 402 tokens as a
    # prompt. Before: prompt_tokens_total moved by 2 and generation_tokens_total by 403.
    outputs, metrics, group = _run(tokenizer, _request(None, [30] * 400, max_tokens=403))
    sample = metrics.registry.get_sample_value
    assert sample("tpserve:prompt_tokens_total") == 402
    assert sample("tpserve:generation_tokens_total") == 3
    last = outputs[-1]
    assert (last.num_prompt_tokens, last.num_completion_tokens) == (402, 3)
    assert [t for out in outputs for t in out.token_ids] == [7, 7, 7]
    # The workers still see the true prompt's length (where the output begins: grammar, penalties, min_tokens).
    assert [new.num_prompt_tokens for new in group.plans[0].new_seqs] == [2]


def test_an_uncontinued_request_counts_as_before(tokenizer) -> None:
    outputs, metrics, _ = _run(tokenizer, _request(None, [], max_tokens=3))
    sample = metrics.registry.get_sample_value
    assert (sample("tpserve:prompt_tokens_total"), sample("tpserve:generation_tokens_total")) == (2, 3)
    assert (outputs[-1].num_prompt_tokens, outputs[-1].num_completion_tokens) == (2, 3)
