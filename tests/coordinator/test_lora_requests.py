"""A request's LoRA adapter on the coordinator: ``lora_name`` -> the workers' slot, NOT_FOUND for an
unknown one, a prefix-cache namespace of its own, and the slot on the wire (tpserve/step_pb.py).
Tokens under an adapter against ``peft``: tests/worker/test_lora.py and tests/e2e/test_lora_serving.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.block_allocator import BlockAllocator
from coordinator.cache_isolation import prefix_cache_namespace
from coordinator.errors import NotFoundError
from coordinator.scheduler import Scheduler
from coordinator.validation import validate_request
from tests.coordinator.fakes import FakeRankGroup, constant, make_engine
from tpserve.step import NewSequence, SamplingParams, StepPlan
from tpserve.step_pb import plan_from_pb, plan_to_pb
from tpserve.v1 import generate_pb2 as pb

VOCAB_SIZE, MAX_MODEL_LEN = 1024, 128
PROMPT = [1, 5, 6, 8, 9, 10, 11, 12, 13]  # two whole blocks of 4
SLOTS = {"sql": 1, "chat": 2}


def _request(lora_name: str | None) -> pb.GenerateRequest:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT),
                                 sampling_params=pb.SamplingParams(temperature=0, max_tokens=2))
    if lora_name is not None:
        request.lora_name = lora_name
    return request


def test_lora_name_selects_its_slot(tokenizer) -> None:
    assert validate_request(_request("chat"), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN, lora_slots=SLOTS).lora_slot == 2
    assert validate_request(_request(None), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN, lora_slots=SLOTS).lora_slot == 0
    assert validate_request(_request(""), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN, lora_slots=SLOTS).lora_slot == 0


def test_an_unknown_adapter_is_not_found_naming_it(tokenizer) -> None:
    with pytest.raises(NotFoundError, match="lora_name 'sq' is not a served adapter; served: chat, sql") as error:
        validate_request(_request("sq"), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN, lora_slots=SLOTS)
    assert error.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(NotFoundError, match="served: none"):  # a server without --enable-lora
        validate_request(_request("sql"), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN)


def test_each_adapter_has_its_own_namespace() -> None:
    base, sql, chat = (prefix_cache_namespace("", "", name) for name in ("", "sql", "chat"))
    assert base == b"" and len({base, sql, chat}) == 3
    # Without an adapter the digest is the one it always was (cached blocks keep their hashes).
    assert prefix_cache_namespace("t", "salt", "") == prefix_cache_namespace("t", "salt")
    assert prefix_cache_namespace("t", "salt", "sql") not in (prefix_cache_namespace("t", "salt"), sql)


def test_the_slot_reaches_the_workers_and_blocks_are_not_shared_across_adapters(tokenizer) -> None:
    group = FakeRankGroup(sample=constant(7))
    scheduler = Scheduler(BlockAllocator(64, 4), max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=True)
    engine = make_engine(group=group, tokenizer=tokenizer, max_model_len=MAX_MODEL_LEN, scheduler=scheduler)

    async def run_all() -> list[int]:
        loop = asyncio.create_task(engine.run())
        cached = []
        try:
            for name in ("sql", "chat", None, "sql"):  # one after the other: each finds what the earlier left
                params = validate_request(_request(name), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN, lora_slots=SLOTS)
                outputs = [out async for out in engine.generate(params)]
                cached.append(outputs[-1].num_cached_prompt_tokens)
        finally:
            loop.cancel()
        return cached

    cached = asyncio.run(run_all())
    new_seqs = [new for plan in group.plans for new in plan.new_seqs]
    assert [new.lora_slot for new in new_seqs] == [1, 2, 0, 1]
    assert cached == [0, 0, 0, 8]  # sql's two blocks: no hit for chat or the base model, a hit for sql


def test_the_slot_crosses_the_wire() -> None:
    plan = StepPlan(3, (NewSequence(5, SamplingParams(), 4, lora_slot=2), NewSequence(6, SamplingParams(), 4)))
    assert [new.lora_slot for new in plan_from_pb(plan_to_pb(plan)).new_seqs] == [2, 0]
