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
import torch

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


def test_penalties_logprobs_and_structured_output_on_the_last_stage(cluster) -> None:
    """The controls the sampling rank (rank 0 of the last stage) applies: penalties and a logit bias
    against transformers' greedy reference, logprobs against its log-softmax, a grammar it built."""
    from tests.e2e.test_sampling_controls import MAX_TOKENS, MIN_TOKENS, PENALTY, logits_of, reference

    prompt = load_goldens()[0]["prompt_token_ids"]
    bias = {286: 3.0, 432: -100.0}
    result = cluster.client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, repetition_penalty=PENALTY,
                                     min_tokens=MIN_TOKENS, logit_bias=bias)
    assert result.token_ids + ([2] if result.finish_reason == "stop" else []) == reference(prompt, bias)
    sampled = cluster.client.generate(prompt, max_tokens=8, temperature=0.8, seed=1, logprobs=True, top_logprobs=4)
    raw = torch.log_softmax(logits_of(prompt + sampled.token_ids)[len(prompt) - 1:-1], dim=-1)  # (8, V)
    for row, (token, lp) in enumerate(zip(sampled.token_ids, sampled.logprobs, strict=True)):
        assert lp.token_id == token and lp.logprob == pytest.approx(float(raw[row, token]), abs=1e-4)
        assert [t.token_id for t in lp.top_logprobs] == raw[row].topk(4).indices.tolist()
    chosen = cluster.client.generate("Once upon a time", max_tokens=8, temperature=1.0, seed=3,
                                     choices=["a cat", "a dog", "the end"])
    assert chosen.text in ("a cat", "a dog", "the end")
