"""A replica that goes silent without closing its connections (its process group stopped with SIGSTOP, as a
frozen VM or a cut link leaves it): the client's keepalive pings (tpserve/service_config.py, ``Keepalive``)
notice it, its calls fail with UNAVAILABLE, and the stream mover continues them on the other replica, token for
token. Without pings the calls waited for the frozen server forever (until their deadline).

Two replicas of stories260k behind ``ipv4:frozen,kept`` with ``pick_first``, so that every call lands on the
replica that is then frozen. The client pings after 1 s without a frame and waits 1 s for the answer (the
defaults, 10 s and 10 s, would make the test wait about 20 s per call).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from tests.e2e.cluster import RunningCluster, serve
from tests.paths import STORIES_DIR, requires_stories
from tpserve.client import Client
from tpserve.service_config import Keepalive
from tpserve.stream_move import MovePolicy, StreamMove

pytestmark = [pytest.mark.e2e, requires_stories]

PROMPT = "Once upon a time, there was a little"
REQUEST = dict(max_tokens=400, temperature=0, ignore_eos=True)
FAST_KEEPALIVE = Keepalive(time_s=1.0, timeout_s=1.0)
#: Seconds from the freeze to the call's end: the 2 s keepalive, a reconnect to the other replica and the rest of
#: the stream there (well under 1 s on stories260k), with room for a loaded CI host. Without pings: the 60 s deadline.
BOUND_S = 12.0


@pytest.fixture()
def replicas() -> Iterator[tuple[RunningCluster, RunningCluster]]:
    """``(frozen, kept)``: the first is stopped by the test and continued (SIGCONT) afterwards, whatever happens."""
    with ExitStack() as stack:
        frozen = stack.enter_context(serve(STORIES_DIR, 1, new_session=True))
        kept = stack.enter_context(serve(STORIES_DIR, 1, new_session=True))
        # Runs before the servers' SIGTERM: a stopped process group would never act on it.
        stack.callback(lambda: frozen.process.poll() is None and os.killpg(frozen.process.pid, signal.SIGCONT))
        yield frozen, kept


def _reference(kept: RunningCluster) -> list[int]:
    with Client(kept.target) as client:
        return [t for chunk in client.generate_stream(PROMPT, **REQUEST) for t in chunk.token_ids]


def test_a_stream_on_a_frozen_replica_moves_to_the_other_token_for_token(replicas) -> None:
    frozen, kept = replicas
    reference = _reference(kept)
    moves: list[StreamMove] = []
    tokens: list[int] = []
    stopped_at = None
    with Client(f"ipv4:{frozen.target},{kept.target}", load_balancing_policy="pick_first",
                move_policy=MovePolicy(on_move=moves.append), keepalive=FAST_KEEPALIVE) as client:
        client.wait_ready(timeout_s=30)
        for chunk in client.generate_stream(PROMPT, **REQUEST, timeout_s=60):
            tokens.extend(chunk.token_ids)
            if stopped_at is None and len(tokens) >= 30:
                os.killpg(frozen.process.pid, signal.SIGSTOP)  # its coordinator and rank: silent, sockets open
                stopped_at = time.monotonic()
        assert stopped_at is not None
        elapsed = time.monotonic() - stopped_at
    assert tokens == reference  # no token lost, none twice
    assert len(moves) == 1 and moves[0].num_delivered_tokens >= 30, moves
    assert moves[0].code.name == "UNAVAILABLE", moves
    assert elapsed < BOUND_S, elapsed


def test_a_unary_call_on_a_frozen_replica_is_answered_by_the_other(replicas) -> None:
    frozen, kept = replicas
    with Client(kept.target) as client:
        reference = client.generate(PROMPT, **REQUEST)
    moves: list[StreamMove] = []
    with Client(f"ipv4:{frozen.target},{kept.target}", load_balancing_policy="pick_first",
                move_policy=MovePolicy(on_move=moves.append), keepalive=FAST_KEEPALIVE) as client:
        client.wait_ready(timeout_s=30)  # connected to the frozen replica (pick_first's first address)
        os.killpg(frozen.process.pid, signal.SIGSTOP)
        started = time.monotonic()
        result = client.generate(PROMPT, **REQUEST, timeout_s=60)
        elapsed = time.monotonic() - started
    assert result.token_ids == reference.token_ids and result.text == reference.text
    # A unary call fails uncommitted: gRPC's own retry policy sends it again (tpserve/service_config.py) before the
    # mover sees it, or the mover does; either way once.
    assert len(moves) <= 1 and all(move.code.name == "UNAVAILABLE" for move in moves), moves
    assert elapsed < BOUND_S, elapsed
