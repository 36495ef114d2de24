"""A simulated workload for engine tests over tests/coordinator/fakes.py's PagedCacheModel: the model
(:func:`next_token`), its reference continuation with no engine (:func:`reference`), requests and a runner."""

from __future__ import annotations

import asyncio
import random

from coordinator.engine import Engine
from coordinator.validation import GenerateParams
from tpserve.step import SamplingParams

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
