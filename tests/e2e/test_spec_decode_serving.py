"""End to end with ``--speculative-method ngram`` on stories260k, at degrees 1 and 2.

References: the shared goldens (Hugging Face ``transformers``, no speculation) token
for token; for sampled requests, the same server's non-speculative path (a request
asking for logprobs does not speculate) over the same seed.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.cluster import serve
from tests.e2e.recovery import _rank_pid
from tests.e2e.spec_decode import spec_counters
from tests.e2e.stories import (
    assert_cancelling_frees_every_block,
    assert_goldens_sixteen_at_once,
    assert_matches_golden,
    assert_streams_match_the_goldens,
    greedy,
)
from tests.paths import STORIES_DIR, load_goldens, requires_stories

pytestmark = [pytest.mark.e2e, requires_stories]

SPEC_FLAGS = ("--speculative-method", "ngram", "--num-speculative-tokens", "4",
              "--prompt-lookup-max", "3", "--prompt-lookup-min", "1")


@pytest.fixture(scope="module", params=[1, 2], ids=lambda tp: f"tp{tp}")
def cluster(request):
    with serve(STORIES_DIR, request.param, *SPEC_FLAGS) as running:
        yield running


def test_goldens_one_at_a_time_with_proposals_accepted(cluster) -> None:
    before = spec_counters(cluster)
    for golden in load_goldens():
        assert_matches_golden(greedy(cluster.client, golden), golden)
    after = spec_counters(cluster)
    drafts = after["tpserve:spec_decode_num_drafts_total"] - before.get("tpserve:spec_decode_num_drafts_total", 0)
    proposed = after["tpserve:spec_decode_num_draft_tokens_total"] - before.get(
        "tpserve:spec_decode_num_draft_tokens_total", 0)
    accepted = after["tpserve:spec_decode_num_accepted_tokens_total"] - before.get(
        "tpserve:spec_decode_num_accepted_tokens_total", 0)
    # Speculation really ran, and both outcomes happened: the goldens came through verification.
    assert drafts > 20 and 0 < accepted < proposed, (drafts, proposed, accepted)
    first = 'tpserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'
    last = 'tpserve:spec_decode_num_accepted_tokens_per_pos_total{position="3"}'
    assert after[first] >= after[last] and after[first] > 0


def test_goldens_sixteen_at_once(cluster) -> None:
    assert_goldens_sixteen_at_once(cluster.client)


def test_stream_deltas_concatenate_to_the_golden(cluster) -> None:
    assert_streams_match_the_goldens(cluster.client)  # several tokens may share a delta


def test_stop_string_stop_token_and_max_tokens_cut_where_they_would_without(cluster) -> None:
    golden = load_goldens()[0]
    stop = "girl nam"  # ends inside the token "▁named"
    result = greedy(cluster.client, golden, stop=[stop])
    assert result.text == golden["text"][: golden["text"].index(stop)] and result.finish_reason == "stop"
    # Usage counts the tokens up to the one that completed the stop string, as without speculation.
    text_tokens = golden["completion_token_ids"]
    assert result.usage.completion_tokens <= len(text_tokens)
    reference = greedy(cluster.client, golden, stop=[stop], logprobs=True)  # logprobs: no speculation
    assert (result.token_ids, result.usage.completion_tokens) == (reference.token_ids, reference.usage.completion_tokens)
    golden = load_goldens()[1]
    stop_id = golden["completion_token_ids"][9]
    first = golden["completion_token_ids"].index(stop_id)
    result = greedy(cluster.client, golden, stop_token_ids=[stop_id])
    assert result.token_ids == golden["completion_token_ids"][:first] and result.finish_reason == "stop"
    for max_tokens in (1, 7, 13):
        result = cluster.client.generate(golden["prompt"], max_tokens=max_tokens, temperature=0)
        assert result.token_ids == golden["completion_token_ids"][:max_tokens] and result.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_matches_the_plain_path(cluster) -> None:
    params = dict(max_tokens=60, temperature=0.8, top_k=40, seed=4321, ignore_eos=True)
    prompt = "Lily and Ben played with the ball. Lily and Ben"
    first = cluster.client.generate(prompt, **params)
    again = cluster.client.generate(prompt, **params)
    assert first.token_ids == again.token_ids and len(first.token_ids) == 60
    plain = cluster.client.generate(prompt, logprobs=True, **params)  # logprobs: decoded one token at a time
    assert plain.token_ids == first.token_ids
    assert cluster.client.generate(prompt, **{**params, "seed": 5}).token_ids != first.token_ids


def test_cancelling_a_speculating_stream_frees_every_block(cluster) -> None:
    assert_cancelling_frees_every_block(cluster)  # blocks reserved for proposals included


def test_a_lost_rank_mid_speculation_costs_no_token(cluster) -> None:
    """Kill -9 of the last rank while 6 speculating streams run: the group restarts, every
    stream resumes by recompute and ends token for token as its golden (or its solo run)."""
    goldens = load_goldens()
    sampled = dict(max_tokens=60, temperature=0.8, top_k=40, seed=9, ignore_eos=True)
    solo = cluster.client.generate("Lily and Ben played", **sampled).token_ids
    info = cluster.client.model_info()
    victim = _rank_pid(cluster.process.pid, info.tensor_parallel_size - 1)
    streams = [cluster.client.generate_stream(g["prompt"], max_tokens=g["max_tokens"], temperature=0)
               for g in goldens] + [cluster.client.generate_stream("Lily and Ben played", **sampled)]
    firsts = [next(stream) for stream in streams]  # every stream is running
    os.kill(victim, signal.SIGKILL)
    with ThreadPoolExecutor(len(streams)) as pool:
        rests = list(pool.map(lambda stream: [t for chunk in stream for t in chunk.token_ids], streams))
    outputs = [list(first.token_ids) + rest for first, rest in zip(firsts, rests)]
    for output, golden in zip(outputs, goldens):
        assert output == golden["completion_token_ids"]
    assert outputs[-1] == list(solo)
    assert cluster.metric("tpserve:worker_restarts_total") >= 1
