"""End to end through ``tpserve serve --tensor-parallel-size 2 --pipeline-parallel-size 2`` on stories260k.

One server (4 ranks: stages of 3 and 2 layers, each a tp-2 group, 2 micro-batches in
flight) for the module, with a KV pool too small for 16 requests at once
(``--num-gpu-blocks-override``: preemption), a 64-token step budget (16 prompts at once
do not fit one step: the last admitted is prefilled in chunks), prefix caching (on by
default) and n-gram speculative decoding (the last stage verifies the proposals). The
references are the shared goldens and ``transformers``: 16 goldens at once and every
golden streamed, token for token; penalties, logprobs and a grammar applied on the last
stage; and last, a killed rank restarts the group (the default recovery) with every
stream token-exact. The metrics show that preemption, prefix caching and speculation ran.
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.cluster import serve
from tests.e2e.stories import assert_goldens_sixteen_at_once, assert_streams_match_the_goldens
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
    from tests.e2e.sampling_reference import MAX_TOKENS, MIN_TOKENS, PENALTY, logits_of, reference

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


def test_a_killed_rank_of_the_last_stage_is_a_lost_group_restarted_with_every_stream_token_exact(cluster) -> None:
    """As tests/e2e/test_recovery.py for a tp group: kill -9 of rank 3 (stage 1) under load; the group
    restarts (the default --worker-recovery-timeout-seconds) and every stream, greedy and seeded, ends
    token for token as it does alone. Last in the module: it restarts the group."""
    from tests.e2e.recovery import MAX_TOKENS, _kill_during_load, _requests

    requests = _requests()
    solo = [cluster.client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True, **s).token_ids for p, s in requests]
    results = _kill_during_load(cluster, 3, requests)
    for (prompt, sampling), result, expected in zip(requests, results, solo, strict=True):
        assert "error" not in result, f"{prompt!r} {sampling}: {result.get('error')}"
        assert result["tokens"] == expected, f"{prompt!r} {sampling} differs from its solo run"
    cluster.client.wait_ready(timeout_s=60)
    assert cluster.metric("tpserve:worker_restarts_total") == 1
    assert cluster.metric("tpserve:kv_cache_free_blocks") == cluster.metric("tpserve:kv_cache_total_blocks")
