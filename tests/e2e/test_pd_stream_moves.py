"""A moved stream carries its KV: two ``kv_both`` replicas of stories260k (tp 1); the one serving the
streams is stopped with SIGTERM, hands each stream's blocks over and ends it with UNAVAILABLE; the
client continues each on the other replica, which pulls the blocks of prompt + delivered tokens
instead of recomputing them (coordinator/kv_transfer/stream_moves.py), with a float cache and with an
8-bit one. Tokens are checked against the kept replica alone."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc

from tests.e2e.cluster import RunningCluster
from tests.e2e.pd import LONG_PROMPT, computed_prompt_tokens, labelled, serve_role
from tests.paths import STORIES_DIR, requires_stories
from tpserve.client import AsyncClient
from tpserve.stream_move import MovePolicy, StreamMove

pytestmark = [pytest.mark.e2e, requires_stories]

BLOCK_SIZE = 16
SAMPLING = [dict(temperature=0.0), dict(temperature=0.9, seed=11), dict(temperature=0.0), dict(temperature=0.7, seed=3)]


@pytest.fixture(scope="module", params=["auto", "int8"], ids=lambda dtype: f"kv-{dtype}")
def replicas(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningCluster, RunningCluster]]:
    """Two kv_both replicas, with a float cache or an 8-bit one (its blocks move with their scale pools).

    A moved stream's blocks wait for their pull for the drain's grace, and the pull for ``pull_timeout_s``: both
    30 s here, not the defaults' 5 and 10, so that a host busy with other tests (CI runs mypy and a plain install
    beside them) does not turn a slow pull into a recompute (the assertion on ``kv_transfer_fallbacks_total``)."""
    tmp = tmp_path_factory.mktemp(f"pd-moves-{request.param}")
    flags = ("--kv-cache-dtype", request.param, "--shutdown-grace-seconds", "30")
    with ExitStack() as stack:
        doomed = stack.enter_context(serve_role(STORIES_DIR, 1, "kv_both", "a", tmp / "a.log", *flags,
                                                pull_timeout_s=30))
        kept = stack.enter_context(serve_role(STORIES_DIR, 1, "kv_both", "b", tmp / "b.log", *flags,
                                              pull_timeout_s=30))
        yield doomed, kept


def test_streams_moved_off_a_draining_replica_pull_their_kv_and_continue_token_for_token(replicas) -> None:
    doomed, kept = replicas
    fields = [dict(max_tokens=160, ignore_eos=True, **s) for s in SAMPLING]
    references = [kept.client.generate(LONG_PROMPT, **f).token_ids for f in fields]  # the kept replica alone
    with grpc.insecure_channel(kept.target) as channel:  # else the references' blocks would be hits there
        assert vllm_engine_pb2_grpc.VllmEngineStub(channel).FlushCache(common_pb2.FlushCacheRequest(), timeout=10).success
    moves: list[StreamMove] = []
    policy = MovePolicy(max_moves=2, initial_backoff_s=0.05, on_move=moves.append)
    received_before = labelled(kept, "tpserve:kv_transfer_blocks_total", direction="received", transport="tcp")
    computed_before = computed_prompt_tokens(kept)

    # Both replicas in the target, doomed first: pick_first sends every first attempt there, and a
    # moved stream's next attempt to the kept one once the doomed one is gone.
    policy_target = f"ipv4:{doomed.target},{kept.target}"

    async def run() -> list[list[int]]:
        async with AsyncClient(policy_target, move_policy=policy, load_balancing_policy="pick_first") as client:
            tokens: list[list[int]] = [[] for _ in fields]

            async def consume(index: int) -> None:
                async for chunk in client.generate_stream(LONG_PROMPT, **fields[index], timeout_s=60):
                    tokens[index].extend(chunk.token_ids)

            tasks = [asyncio.create_task(consume(i)) for i in range(len(fields))]
            deadline = time.monotonic() + 30
            while min(len(t) for t in tokens) < 20:
                assert time.monotonic() < deadline, [len(t) for t in tokens]
                await asyncio.sleep(0.005)
            doomed.process.send_signal(signal.SIGTERM)
            await asyncio.gather(*tasks)
            return tokens

    got = asyncio.run(run())
    assert got == references
    assert len(moves) == len(fields) and all(m.num_delivered_tokens >= 20 for m in moves), moves
    assert all("continue on another replica with its KV" in m.details for m in moves)
    # The kept replica pulled the streams' full blocks (prompt + delivered tokens) and computed only
    # what followed the last one: under a block per stream. Every stream shares the prompt's blocks
    # and the greedy ones their output's, so a block one stream pulled is a prefix hit for the
    # others: at least one stream's worth was pulled, each stream's rest found there or pulled.
    pulled = labelled(kept, "tpserve:kv_transfer_blocks_total", direction="received", transport="tcp") - received_before
    assert pulled >= (len(LONG_PROMPT.split()) + 20) // BLOCK_SIZE
    assert computed_prompt_tokens(kept) - computed_before <= len(fields) * BLOCK_SIZE
    assert labelled(kept, "tpserve:kv_transfer_fallbacks_total", reason="failed") == 0
    assert doomed.process.wait(30) == 0  # drained in order once the holds were pulled
