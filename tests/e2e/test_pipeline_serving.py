"""End to end through ``tpserve serve --tensor-parallel-size 2 --pipeline-parallel-size 2`` on stories260k.

One server (4 ranks: stages of 3 and 2 layers, each a tp-2 group) for the module,
with a KV pool too small for 16 requests at once (``--num-gpu-blocks-override``:
preemption), a small step budget (``--max-num-batched-tokens``: chunked prefill),
prefix caching (on by default) and n-gram speculative decoding (the last stage
verifies the proposals). The reference is the shared goldens (``transformers``):
every golden alone, 16 at once and streamed must be token for token the golden, and
the metrics show that each of those paths ran.
"""

from __future__ import annotations

import pytest

from tests.e2e.cluster import serve
from tests.e2e.test_stories_serving import (assert_goldens_sixteen_at_once, assert_matches_golden,
                                            assert_streams_match_the_goldens, greedy)
from tests.paths import STORIES_DIR, load_goldens, requires_stories

pytestmark = [pytest.mark.e2e, requires_stories]

#: 16 blocks of 16 tokens (--max-model-len 128): about 3 golden requests of 80 tokens at once, so 16 at once preempt.
NUM_BLOCKS = 16


@pytest.fixture(scope="module")
def cluster():
    with serve(STORIES_DIR, 2, "--pipeline-parallel-size", "2", "--num-gpu-blocks-override", str(NUM_BLOCKS),
               "--max-num-batched-tokens", "64", "--max-num-seqs", "16", "--max-model-len", "128",
               "--speculative-method", "ngram", "--num-speculative-tokens", "3") as running:
        yield running


def test_model_info_reports_the_layout(cluster) -> None:
    info = cluster.client.model_info()
    assert (info.tensor_parallel_size, info.pipeline_parallel_size, info.num_kv_blocks) == (2, 2, NUM_BLOCKS)


def test_goldens_one_at_a_time(cluster) -> None:
    for golden in load_goldens():
        assert_matches_golden(greedy(cluster.client, golden), golden)


def test_goldens_sixteen_at_once_with_preemption(cluster) -> None:
    before = cluster.metric("tpserve:num_preemptions_total")
    assert_goldens_sixteen_at_once(cluster.client)
    assert cluster.metric("tpserve:num_preemptions_total") > before  # the pool could not hold them all
    assert cluster.metric("tpserve:prefix_cache_hits_total") > 0  # the cycled goldens share prompts
    assert cluster.metric("tpserve:spec_decode_num_accepted_tokens_total") > 0  # verified on the last stage


def test_streams_match_the_goldens(cluster) -> None:
    assert_streams_match_the_goldens(cluster.client, min_chunks=4)
