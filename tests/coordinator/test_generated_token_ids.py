"""A continued request (``generated_token_ids``): validated like every field, and entering the
engine in the state a sequence resumed by recompute has (docs/design/faults.md, "Recovery").

Stand-in worker groups record the plans, so the test sees what the workers would be sent.
Token-for-token equality with an uninterrupted request on a real model is in
tests/cluster/test_stream_move.py.
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.engine import Engine
from coordinator.errors import InvalidArgumentError
from coordinator.tokenizer import Tokenizer
from coordinator.validation import validate_request
from tests.coordinator.fakes import FakeRankGroup, constant, make_engine
from tpserve.v1 import generate_pb2 as pb

VOCAB_SIZE = 1024  # the embedded model's tokenizer
MAX_MODEL_LEN = 128
PROMPT = [1, 5, 6, 8]


def _request(generated, max_tokens: int | None = 8, **sampling) -> pb.GenerateRequest:
    params = pb.SamplingParams(temperature=0, **sampling)
    if max_tokens is not None:
        params.max_tokens = max_tokens
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling_params=params,
                              generated_token_ids=generated)


def test_a_valid_continuation_is_kept(tokenizer) -> None:
    params = validate_request(_request([30, 40, 50]), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN)
    assert params.generated_token_ids == (30, 40, 50) and params.max_tokens == 8
    assert validate_request(_request([]), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN).generated_token_ids == ()


@pytest.mark.parametrize(("request_", "message"), [
    (_request([30, VOCAB_SIZE]), f"generated_token_ids contains {VOCAB_SIZE}; token ids must be in [0, {VOCAB_SIZE})"),
    (_request([30, -1]), "generated_token_ids contains -1"),
    (_request([30] * 8), "generated_token_ids has 8 tokens; a continued request has fewer than max_tokens=8"),
    # Without max_tokens, the prompt's room in the context is the limit.
    (_request([30] * (MAX_MODEL_LEN - len(PROMPT)), max_tokens=None),
     f"fewer than max_tokens={MAX_MODEL_LEN - len(PROMPT)}"),
    (_request([30], n=2), "generated_token_ids continues one completion; it needs sampling_params.n = 1, got 2"),
    (_request([30, 41], stop_token_ids=[41]), "generated_token_ids contains the stop token 41"),
], ids=["id-out-of-vocab", "negative-id", "as-many-as-max-tokens", "fills-the-context", "n-2", "stop-token"])
def test_a_bad_continuation_is_invalid_argument_naming_the_field(tokenizer, request_, message) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        validate_request(request_, tokenizer, VOCAB_SIZE, MAX_MODEL_LEN)
    assert message in str(info.value)


def test_an_eos_in_the_continuation_is_refused_unless_ignore_eos(tokenizer) -> None:
    eos = min(tokenizer.eos_token_ids)
    with pytest.raises(InvalidArgumentError, match=f"generated_token_ids contains the stop token {eos}"):
        validate_request(_request([30, eos]), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN)
    assert validate_request(_request([30, eos], ignore_eos=True), tokenizer, VOCAB_SIZE,
                            MAX_MODEL_LEN).generated_token_ids == (30, eos)


def _engine(tokenizer: Tokenizer, group: FakeRankGroup) -> Engine:
    return make_engine(group=group, tokenizer=tokenizer, max_model_len=MAX_MODEL_LEN)


async def _run(engine: Engine, params) -> list:
    loop = asyncio.create_task(engine.run())
    try:
        return [out async for out in engine.generate(params)]
    finally:
        loop.cancel()


def test_the_continuation_is_recomputed_as_output_and_counts_towards_max_tokens(tokenizer) -> None:
    group = FakeRankGroup(sample=constant(7))
    engine = _engine(tokenizer, group)
    params = validate_request(_request([30, 40], max_tokens=6), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN)
    outputs = asyncio.run(_run(engine, params))
    # The workers see the prompt and the earlier output in one chunk from position 0, the prompt's
    # length telling them where the output begins (min_tokens, penalties, grammar): a resumed sequence.
    first = group.plans[0]
    assert [new.num_prompt_tokens for new in first.new_seqs] == [len(PROMPT)]
    assert first.scheduled[0].token_ids == (*PROMPT, 30, 40) and first.scheduled[0].start_position == 0
    # Only the new tokens come back; max_tokens counts the earlier two, and usage counts them as
    # prompt tokens: this server computed, and did not generate, them (docs/design/cluster.md, "A continuation is
    # checked like output").
    assert [t for out in outputs for t in out.token_ids] == [7, 7, 7, 7]
    assert outputs[-1].finish_reason.value == "length"
    assert (outputs[-1].num_prompt_tokens, outputs[-1].num_completion_tokens) == (len(PROMPT) + 2, 4)
    assert engine.scheduler.allocator.num_free_blocks == 64


def test_a_continuation_whose_text_holds_a_stop_string_is_refused(tokenizer) -> None:
    tokens = tokenizer.encode("The cat sat down.", parse_special_tokens=False)[1:]
    request = _request(tokens, max_tokens=40, stop=["sat"])
    params = validate_request(request, tokenizer, VOCAB_SIZE, MAX_MODEL_LEN)
    engine = _engine(tokenizer, FakeRankGroup(sample=constant(7)))
    with pytest.raises(InvalidArgumentError, match="the text of generated_token_ids contains a stop string"):
        asyncio.run(_run(engine, params))
    assert engine.num_requests == 0 and engine.scheduler.allocator.num_free_blocks == 64
