"""The prefix cache's host tier end to end on stories260k, at tp 1 and 2 (each rank copies its own KV slice),
with two pipeline stages (each its own layers) and with async scheduling.

A device pool of 32 blocks of 16 (one 512-token sequence) and a host tier of 320: six 200-token prompts,
one at a time, twice. The working set (6 x 13 blocks) does not fit the pool but fits the tier, so the
second round finds every prompt's 12 full blocks before its last token (192 tokens, the ideal) in the
host tier, and its tokens equal those of a server with an unbounded pool and no tier. ``/metrics``
counts the hits and the bytes moved; a request of another ``cache_salt`` finds nothing through the tier;
the KV events (the engine protocol's SubscribeKvEvents) say which tier each block entered or left.

A rank killed (SIGKILL) restarts the group once: the replacement ranks allocate the tier again (with a draft
model's layers, and sized by ``--kv-offloading-size``), the coordinator forgets the blocks it named (the new
slots are empty, so nothing stale is served), and the tier hits again, token for token.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
import urllib.request

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc

from tests.e2e.cluster import serve
from tests.e2e.recovery import _rank_pid
from tests.e2e.stories import assert_matches_golden, greedy
from tests.paths import STORIES_DIR, load_goldens, requires_stories

pytestmark = [pytest.mark.e2e, requires_stories]

BOS, VOCAB_SIZE, BLOCK_SIZE = 1, 512, 16
_rng = random.Random(45)
PROMPTS = [[BOS] + [_rng.randrange(3, VOCAB_SIZE) for _ in range(199)] for _ in range(6)]
IDEAL = (200 - 1) // BLOCK_SIZE * BLOCK_SIZE  # 192
SMALL = ("--block-size", str(BLOCK_SIZE), "--max-model-len", "512", "--num-gpu-blocks-override", "32")


def _rounds(client, salt: str = "a") -> list:
    return [client.generate(p, max_tokens=8, temperature=0, ignore_eos=True, cache_salt=salt)
            for _ in range(2) for p in PROMPTS]


def _metric(cluster, name: str, label: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5).read().decode()
    match = re.search(rf"^{re.escape(name)}\{{{label}\}} (\S+)$", body, re.M)
    assert match, name
    return float(match.group(1))


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with serve(STORIES_DIR, 1, "--block-size", str(BLOCK_SIZE), "--max-model-len", "512") as cluster:
        return [r.token_ids for r in _rounds(cluster.client)]


#: (tensor_parallel_size, more flags): tp 2 (each rank copies its own KV heads), two pipeline stages (each its
#: own layers), and async scheduling forced on (plans made before the previous step's result).
LAYOUTS = {"tp1": (1, ()), "tp2": (2, ()), "pp2": (1, ("--pipeline-parallel-size", "2")),
           "tp1-async": (1, ("--async-scheduling",))}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_working_set_beyond_the_pool_hits_in_the_host_tier(reference, layout: str) -> None:
    tp, flags = LAYOUTS[layout]
    with serve(STORIES_DIR, tp, *SMALL, *flags, "--num-cpu-blocks-override", "320") as cluster, \
            grpc.insecure_channel(cluster.target) as channel:
        events = vllm_engine_pb2_grpc.VllmEngineStub(channel).SubscribeKvEvents(
            common_pb2.SubscribeKvEventsRequest(), timeout=120)
        time.sleep(0.2)  # subscribed
        results = _rounds(cluster.client)
        _check_events(events)
        assert [r.token_ids for r in results] == reference
        assert [r.usage.cached_prompt_tokens for r in results] == [0] * 6 + [IDEAL] * 6
        assert cluster.metric("tpserve:kv_offload_hits_total") == 6 * IDEAL
        assert cluster.metric("tpserve:kv_offload_total_blocks") == 320
        stores = cluster.metric("tpserve:kv_offload_stores_total")
        assert stores >= 6 * 12
        to_device = _metric(cluster, "tpserve:kv_offload_bytes_total", 'direction="to_device"')
        to_host = _metric(cluster, "tpserve:kv_offload_bytes_total", 'direction="to_host"')
        assert to_device / (6 * 12) == to_host / stores > 0  # whole blocks, summed over the ranks
        other = cluster.client.generate(PROMPTS[0], max_tokens=8, temperature=0, ignore_eos=True, cache_salt="b")
        assert other.usage.cached_prompt_tokens == 0 and other.token_ids == reference[0]


def _check_events(events) -> None:
    """Every block stored in the host tier ("CPU") was stored on the device ("GPU") and evicted from it first;
    the second round's hits come back to the device (stored "GPU" again)."""
    seen: list[tuple[str, str, int]] = []  # (kind, medium, block hash) in order
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        batch = next(events)
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                seen += [("stored", event.stored.medium, b.block_hash) for b in event.stored.blocks]
                assert event.stored.tier == {"GPU": common_pb2.KV_CACHE_TIER_DEVICE,
                                             "CPU": common_pb2.KV_CACHE_TIER_HOST}[event.stored.medium]
            elif kind == "removed":
                seen += [("removed", event.removed.medium, h) for h in event.removed.block_hashes]
        if sum(1 for kind, medium, _ in seen if kind == "stored" and medium == "CPU") >= 6 * 12 and \
                sum(1 for kind, medium, _ in seen if kind == "stored" and medium == "GPU") >= 2 * 6 * 12:
            break
    events.cancel()
    to_host = [h for kind, medium, h in seen if kind == "stored" and medium == "CPU"]
    assert len(to_host) >= 6 * 12, "too few host-tier stores announced"
    for block_hash in to_host:
        first_gpu = seen.index(("stored", "GPU", block_hash))
        evicted = seen.index(("removed", "GPU", block_hash))
        assert first_gpu < evicted < seen.index(("stored", "CPU", block_hash))
    back = [h for h in to_host if sum(1 for e in seen if e == ("stored", "GPU", h)) >= 2]
    assert len(back) >= 6 * 12  # each round-2 hit was announced on the device again


def test_without_the_tier_the_same_pool_finds_nothing() -> None:
    with serve(STORIES_DIR, 1, *SMALL) as cluster:
        results = _rounds(cluster.client)
        assert [r.usage.cached_prompt_tokens for r in results] == [0] * 12
        assert cluster.metric("tpserve:kv_offload_total_blocks") == 0


#: (tensor_parallel_size, the rank killed, more flags): the tier sized in blocks, at tp 1 and 2, and in GiB
#: (--kv-offloading-size: 8 MiB, far more than 6 x 13 blocks) with a draft model, whose layers the slots hold too.
RESTARTS = {"tp1": (1, 0, ("--num-cpu-blocks-override", "320")),
            "tp2": (2, 1, ("--num-cpu-blocks-override", "320")),
            "tp1-draft-size": (1, 0, ("--kv-offloading-size", "0.0078125", "--speculative-method", "draft",
                                      "--speculative-model", str(STORIES_DIR), "--num-speculative-tokens", "3"))}


@pytest.mark.parametrize("layout", sorted(RESTARTS))
def test_a_restarted_group_has_its_host_tier_again(reference, tmp_path, layout: str) -> None:
    tp, rank, flags = RESTARTS[layout]
    log_path = tmp_path / "server.log"
    with serve(STORIES_DIR, tp, *SMALL, *flags, "--worker-recovery-timeout-seconds", "90",
               log_path=log_path) as cluster:
        assert [r.token_ids for r in _rounds(cluster.client)] == reference
        assert cluster.metric("tpserve:kv_offload_hits_total") == 6 * IDEAL
        os.kill(_rank_pid(cluster.process.pid, rank), signal.SIGKILL)
        deadline = time.monotonic() + 90
        while cluster.metric("tpserve:worker_restarts_total") < 1:
            assert time.monotonic() < deadline, "the group did not restart"
            time.sleep(0.2)
        cluster.client.wait_ready(timeout_s=30)
        results = _rounds(cluster.client)
        assert [r.token_ids for r in results] == reference
        # The new slots are empty: the first round finds nothing there (no stale hit), the second all it stored.
        assert [r.usage.cached_prompt_tokens for r in results] == [0] * 6 + [IDEAL] * 6
        assert cluster.metric("tpserve:kv_offload_hits_total") == 2 * 6 * IDEAL
        for golden in load_goldens():
            assert_matches_golden(greedy(cluster.client, golden), golden)
        assert cluster.metric("tpserve:worker_restarts_total") == 1  # a step with host-tier copies failed none
    log = log_path.read_text(errors="replace")
    assert log.count("kv host tier allocated") == 2 * tp, "the replacement ranks did not allocate the tier"
    assert "has no host tier" not in log
