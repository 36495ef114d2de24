"""A simulated workload for engine tests over tests/coordinator/fakes.py's PagedCacheModel: the model
(:func:`next_token`), its reference continuation with no engine (:func:`reference`), requests and a runner."""

from __future__ import annotations

import asyncio
import random

from coordinator.detokenizer import IncrementalDetokenizer
from coordinator.engine import Engine
from coordinator.sequence import FinishReason
from coordinator.tokenizer import Tokenizer
from coordinator.validation import GenerateParams
from tests.coordinator.fakes import FakeRankGroup
from tpserve.embedded_model import default_model_dir
from tpserve.step import SamplingParams, StepPlan

BLOCK_SIZE = 4
VOCAB = [315, 322, 344, 365, 973, 619, 357, 352, 844, 318, 994, 401, 512, 777, 2]  # 2 is eos


def next_token(tokens: list[int]) -> int:
    """The simulated model: the next token is a fixed function of the whole context."""
    return VOCAB[hash(tuple(tokens)) % len(VOCAB)]


def reference(prompt: list[int], max_tokens: int, stop_ids: frozenset[int] = frozenset()) -> list[int]:
    """Greedy continuation under ``next_token``; a stop token ends it (and is not returned)."""
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        token = next_token(tokens)
        if token in stop_ids:
            break
        out.append(token)
        tokens.append(token)
    return out


def params(request_id: str, prompt: list[int], max_tokens: int, stop: tuple[str, ...] = (),
            stop_ids: frozenset[int] = frozenset(), priority: int = 0) -> GenerateParams:
    return GenerateParams(request_id, prompt, max_tokens, SamplingParams(temperature=0.0), stop, stop_ids,
                          True, priority=priority)


def run(engine: Engine, *waves: list[tuple[float, GenerateParams]], timeout_s: float = 20) -> list[list]:
    """Each wave of requests after the one before has finished, each request sent after its
    delay (seconds); every request's outputs, in order."""
    async def one(delay: float, params: GenerateParams) -> list:
        await asyncio.sleep(delay)
        return [out async for out in engine.generate(params)]

    async def go() -> list[list]:
        loop = asyncio.create_task(engine.run())
        try:
            results = []
            for wave in waves:
                results += await asyncio.wait_for(asyncio.gather(*(one(d, p) for d, p in wave)), timeout_s)
            return results
        finally:
            loop.cancel()

    return asyncio.run(go())


def tokens_of(outputs: list) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def workload(seed: int, num: int) -> list[tuple[float, GenerateParams]]:
    rng = random.Random(seed)
    shared = [1, 5, 6, 8, 9, 10, 11]  # a prefix several prompts share (prefix caching)
    requests = []
    for i in range(num):
        prompt = (shared if i % 2 else []) + [rng.randrange(3, 900) for _ in range(rng.randrange(1, 14))]
        requests.append((rng.random() * 0.02, params(f"r{i}", prompt, rng.randrange(1, 24))))
    return requests


def check_stop_string_and_abort(engine: Engine, ranks: FakeRankGroup, abort_at_step: int) -> None:
    """Three requests, one stopped by a stop string in its 6th token's text or before, one aborted when
    plan ``abort_at_step`` is sent, one run to its length, then a second wave: every token is the
    reference's, usage counts only the tokens returned, the workers were told to drop every sequence of
    the first wave (no plan's drops were lost) and every block of ``engine``'s 64 is free again."""
    prompt = [1, 5, 6, 8]
    detokenizer = IncrementalDetokenizer(Tokenizer.from_pretrained(default_model_dir()), prompt)
    text = "".join(detokenizer.step(token) for token in reference(prompt, 6))
    stop = text[len(text) // 2:len(text) // 2 + 3]

    def abort_r1(plan: StepPlan) -> None:
        if plan.step_id == abort_at_step and engine.scheduler.running:
            assert engine.abort_request("r1") == 1

    ranks.on_submit = abort_r1
    first = [(0.0, params("r0", prompt, 20, stop=(stop,))), (0.0, params("r1", [1, 9, 9], 30)),
             (0.0, params("r2", [2, 3], 12))]
    second = [(0.0, params("s0", [1, 5, 6, 8], 5)), (0.0, params("s1", [4, 4], 7))]
    stopped, aborted, full, *later = run(engine, first, second)
    assert "".join(o.text for o in stopped) == text[:text.index(stop)] and stopped[-1].finish_reason is FinishReason.STOP
    assert tokens_of(stopped) == reference(prompt, len(tokens_of(stopped)))
    # Usage counts the tokens returned, not those sampled after the stop string's (steps in flight, a plan's later steps).
    assert stopped[-1].num_completion_tokens == len(tokens_of(stopped)) <= 6
    assert aborted[-1].finish_reason is FinishReason.ABORT
    assert tokens_of(aborted) == reference([1, 9, 9], len(tokens_of(aborted))) and len(tokens_of(aborted)) < 30
    assert tokens_of(full) == reference([2, 3], 12)
    for (_, request), outputs in zip(second, later):
        assert tokens_of(outputs) == reference(request.prompt_token_ids, request.max_tokens)
    assert not {0, 1, 2} & set(ranks.model.tables)
    assert engine.scheduler.allocator.num_free_blocks == 64
