"""A hybrid model's streams move to another replica token for token (docs/design/cluster.md, "A broken stream
moves to another replica"): the tiny LFM2 checkpoint of tests/worker/hybrid_specs.py on two replicas.

The replica a stream moves to prefills the prompt and the delivered tokens as its prompt, its
convolution states rebuilt from them (or resumed from a saved prefix state), and continues with
exactly the tokens the first replica would have sent. Twelve streams (greedy with logprobs, seeded
sampling with a repetition penalty) through the ``AsyncClient``; one replica's process group is
killed with SIGKILL mid-stream; every stream completes equal to the same request on the other replica.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.e2e.cluster import RunningCluster, serve
from tests.paths import STORIES_DIR, requires_stories
from tests.tiny_models import save_servable_model
from tests.worker.hybrid_specs import LFM2
from tpserve.client import AsyncClient
from tpserve.stream_move import MovePolicy, StreamMove

pytestmark = [pytest.mark.e2e, requires_stories]

PROMPT = "Once upon a time, there was a little"
KINDS = {
    "greedy": dict(max_tokens=80, temperature=0, ignore_eos=True, logprobs=True),
    "sampled": dict(max_tokens=80, temperature=0.9, top_p=0.95, seed=77, repetition_penalty=1.3, ignore_eos=True),
}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningCluster, RunningCluster]]:
    model_dir: Path = save_servable_model(LFM2, tmp_path_factory.mktemp("lfm2"), STORIES_DIR)
    with ExitStack() as stack:
        doomed = stack.enter_context(serve(model_dir, 1, new_session=True))
        kept = stack.enter_context(serve(model_dir, 1, new_session=True))
        yield doomed, kept


def test_hybrid_streams_move_off_a_killed_replica_token_for_token(replicas) -> None:
    doomed, kept = replicas
    references = {name: kept.client.generate(PROMPT, **kwargs) for name, kwargs in KINDS.items()}
    names = list(KINDS) * 6
    moves: list[StreamMove] = []
    policy = MovePolicy(max_moves=4, initial_backoff_s=0.05, on_move=moves.append)

    async def main() -> list[list]:
        async with AsyncClient(f"ipv4:{doomed.target},{kept.target}", move_policy=policy) as client:
            received: list[list] = [[] for _ in names]

            async def consume(index: int, name: str) -> None:
                async for chunk in client.generate_stream(PROMPT, **KINDS[name], timeout_s=60):
                    received[index].append(chunk)

            served = await asyncio.to_thread(doomed.metric, "tpserve:prompt_tokens_total")
            deadline = time.monotonic() + 30
            while await asyncio.to_thread(doomed.metric, "tpserve:prompt_tokens_total") == served:
                assert time.monotonic() < deadline, "round_robin never picked the doomed replica"
                await client.generate(PROMPT, max_tokens=1)
            tasks = [asyncio.create_task(consume(i, name)) for i, name in enumerate(names)]
            deadline = time.monotonic() + 30
            while min(len(r) for r in received) < 3 or \
                    await asyncio.to_thread(doomed.metric, "tpserve:num_requests_running") < 2:
                assert time.monotonic() < deadline, [len(r) for r in received]
                await asyncio.sleep(0.002)
            os.killpg(doomed.process.pid, signal.SIGKILL)
            await asyncio.gather(*tasks)
            return received

    received = asyncio.run(main())
    assert sum(move.num_delivered_tokens > 0 for move in moves) >= 2, moves
    for name, chunks in zip(names, received, strict=True):
        full = references[name]
        assert [t for c in chunks for t in c.token_ids] == list(full.token_ids), name
        assert "".join(c.text for c in chunks) == full.text, name
        assert [lp.logprob for c in chunks for lp in c.logprobs] == \
            pytest.approx([lp.logprob for lp in full.logprobs], abs=1e-4), name
