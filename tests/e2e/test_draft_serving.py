"""End to end with ``--speculative-method draft`` on stories260k: tp 1 with itself as the draft
(nearly every proposal accepted), tp 2 with a seeded random draft of the same vocabulary
(nearly every one rejected). Reference: the shared goldens, token for token; for sampled
requests the same server's non-speculative path (logprobs requests do not speculate).
"""

from __future__ import annotations

import pytest

from tests.e2e.cluster import serve
from tests.e2e.spec_decode import spec_counters
from tests.e2e.stories import (
    assert_cancelling_frees_every_block,
    assert_goldens_sixteen_at_once,
    assert_matches_golden,
    greedy,
)
from tests.paths import STORIES_DIR, load_goldens, requires_stories
from tests.tiny_models import TinyModelSpec, save_tiny_model

pytestmark = [pytest.mark.e2e, requires_stories]

RANDOM_DRAFT = TinyModelSpec("draft512", "llama", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "vocab_size": 512, "tie_word_embeddings": True}, seed=7)


@pytest.fixture(scope="module", params=[(1, "self"), (2, "random")], ids=lambda p: f"tp{p[0]}-{p[1]}-draft")
def cluster(request, tmp_path_factory):
    tp, kind = request.param
    draft = STORIES_DIR if kind == "self" else save_tiny_model(RANDOM_DRAFT, tmp_path_factory.mktemp("draft") / "d")
    with serve(STORIES_DIR, tp, "--speculative-method", "draft", "--speculative-model", str(draft),
               "--num-speculative-tokens", "3") as running:
        running.draft_kind = kind
        yield running


def test_goldens_alone_and_sixteen_at_once(cluster) -> None:
    goldens = load_goldens()
    for golden in goldens:
        assert_matches_golden(greedy(cluster.client, golden), golden)
    assert_goldens_sixteen_at_once(cluster.client)
    counters = spec_counters(cluster)
    proposed = counters["tpserve:spec_decode_num_draft_tokens_total"]
    accepted = counters["tpserve:spec_decode_num_accepted_tokens_total"]
    assert counters["tpserve:spec_decode_num_drafts_total"] > 20
    if cluster.draft_kind == "self":
        assert accepted > 0.9 * proposed
    else:
        assert accepted < 0.5 * proposed


def test_seeded_sampling_is_reproducible_and_matches_the_plain_path(cluster) -> None:
    params = dict(max_tokens=40, temperature=0.8, top_k=40, seed=77, ignore_eos=True)
    first = cluster.client.generate("The little dog", **params)
    assert cluster.client.generate("The little dog", **params).token_ids == first.token_ids
    assert cluster.client.generate("The little dog", logprobs=True, **params).token_ids == first.token_ids


def test_cancelling_a_stream_frees_every_block(cluster) -> None:
    assert_cancelling_frees_every_block(cluster)  # the draft's cache shares the blocks
