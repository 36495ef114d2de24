"""Prefix caching end to end on stories260k: the same tokens as without it, at degrees 1 and 2.

16 greedy requests share a 200-token prefix (12 full blocks of 16, then 8 tokens) and
differ after it. With ``--no-enable-prefix-caching`` they are all computed in full; that
run is the reference. With ``--enable-prefix-caching`` the first request fills the
cache, and the other 15, sent at once, reuse its 12 blocks: their tokens must be
exactly the reference's, their usage must say 192 cached prompt tokens, and
``/metrics`` must count the hits.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.cluster import serve
from tests.paths import STORIES_DIR, requires_stories

pytestmark = [pytest.mark.e2e, requires_stories]

BOS, VOCAB_SIZE, BLOCK_SIZE = 1, 512, 16
_rng = random.Random(9)
PREFIX = [BOS] + [_rng.randrange(3, VOCAB_SIZE) for _ in range(199)]
PROMPTS = [PREFIX + [_rng.randrange(3, VOCAB_SIZE) for _ in range(8)] for _ in range(16)]
SHARED_TOKENS = len(PREFIX) // BLOCK_SIZE * BLOCK_SIZE  # 192


def generate_all(client, prompts: list[list[int]]) -> list:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client.generate(p, max_tokens=12, temperature=0, ignore_eos=True), prompts))


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with serve(STORIES_DIR, 1, "--no-enable-prefix-caching", "--block-size", str(BLOCK_SIZE)) as cluster:
        results = generate_all(cluster.client, PROMPTS)
        assert all(r.usage.cached_prompt_tokens == 0 for r in results)
        assert cluster.metric("tpserve:prefix_cache_queries_total") == 0
    return [r.token_ids for r in results]


@pytest.mark.parametrize("tp", [1, 2], ids=lambda tp: f"tp{tp}")
def test_shared_prefix_gives_the_uncached_tokens(reference, tp: int) -> None:
    with serve(STORIES_DIR, tp, "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE)) as cluster:
        (first,) = generate_all(cluster.client, PROMPTS[:1])
        rest = generate_all(cluster.client, PROMPTS[1:])
        assert [r.token_ids for r in [first, *rest]] == reference
        assert first.usage.cached_prompt_tokens == 0
        assert [r.usage.cached_prompt_tokens for r in rest] == [SHARED_TOKENS] * 15
        assert all(r.usage.prompt_tokens == len(PROMPTS[0]) for r in [first, *rest])
        assert cluster.metric("tpserve:prefix_cache_queries_total") == 16 * len(PROMPTS[0])
        assert cluster.metric("tpserve:prefix_cache_hits_total") == 15 * SHARED_TOKENS
