"""The prefix cache's host tier end to end on stories260k, at tp 1 and 2 (each rank copies its own KV slice).

A device pool of 32 blocks of 16 (one 512-token sequence) and a host tier of 320: six 200-token prompts,
one at a time, twice. The working set (6 x 13 blocks) does not fit the pool but fits the tier, so the
second round finds every prompt's 12 full blocks before its last token (192 tokens, the ideal) in the
host tier, and its tokens equal those of a server with an unbounded pool and no tier. ``/metrics``
counts the hits and the bytes moved; a request of another ``cache_salt`` finds nothing through the tier.
"""

from __future__ import annotations

import random
import re
import urllib.request

import pytest

from tests.e2e.cluster import serve
from tests.paths import STORIES_DIR, requires_stories

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


@pytest.mark.parametrize("tp", [1, 2], ids=lambda tp: f"tp{tp}")
def test_a_working_set_beyond_the_pool_hits_in_the_host_tier(reference, tp: int) -> None:
    with serve(STORIES_DIR, tp, *SMALL, "--num-cpu-blocks-override", "320") as cluster:
        results = _rounds(cluster.client)
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


def test_without_the_tier_the_same_pool_finds_nothing() -> None:
    with serve(STORIES_DIR, 1, *SMALL) as cluster:
        results = _rounds(cluster.client)
        assert [r.usage.cached_prompt_tokens for r in results] == [0] * 12
        assert cluster.metric("tpserve:kv_offload_total_blocks") == 0
