"""Checks on a served stories model (goldens at once, cancellations free every block), shared by the serving tests of each layout."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.paths import load_goldens


def greedy(client, golden, **kwargs):
    return client.generate(golden["prompt"], max_tokens=golden["max_tokens"], temperature=0, **kwargs)


def assert_matches_golden(result, golden) -> None:
    assert result.token_ids == golden["completion_token_ids"]
    assert result.text == golden["text"]
    assert result.finish_reason == golden["finish_reason"]
    assert result.usage.prompt_tokens == len(golden["prompt_token_ids"])
    assert result.usage.completion_tokens == len(golden["completion_token_ids"]) + (golden["finish_reason"] == "stop")


def assert_goldens_sixteen_at_once(client) -> None:
    """16 greedy requests at once (the goldens, cycled), each token for token its golden."""
    goldens = load_goldens()
    batch = [goldens[i % len(goldens)] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda g: greedy(client, g), batch))
    for result, golden in zip(results, batch):
        assert_matches_golden(result, golden)


def assert_streams_match_the_goldens(client, min_chunks: int = 1, max_chunks: int | None = None) -> None:
    """Each golden streamed: the deltas join to its text and tokens; finish_reason and usage only at the end.

    ``min_chunks``: each stream has more deltas than this (it really streamed); ``max_chunks``: and at most
    this many (tokens that reach the coordinator together go out together).
    """
    for golden in load_goldens():
        chunks = list(client.generate_stream(golden["prompt"], max_tokens=golden["max_tokens"], temperature=0))
        assert "".join(c.text for c in chunks) == golden["text"]
        assert [t for c in chunks for t in c.token_ids] == golden["completion_token_ids"]
        assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
        assert chunks[-1].usage.completion_tokens == len(golden["completion_token_ids"])
        assert len(chunks) > min_chunks
        assert max_chunks is None or len(chunks) <= max_chunks, len(chunks)


def wait_all_blocks_free(cluster, timeout_s: float = 10.0) -> None:
    total = cluster.metric("tpserve:kv_cache_total_blocks")
    deadline = time.monotonic() + timeout_s
    while cluster.metric("tpserve:kv_cache_free_blocks") != total:
        assert time.monotonic() < deadline, "KV blocks were not freed"
        time.sleep(0.05)
    assert cluster.metric("tpserve:num_requests_running") == 0


def assert_cancelling_frees_every_block(cluster) -> None:
    """A long stream cancelled after 5 deltas ends CANCELLED, and every KV block it held comes back."""
    stream = cluster.client.generate_stream("Once upon a time", max_tokens=400, temperature=0, ignore_eos=True)
    received = [next(stream) for _ in range(5)]
    assert all(chunk.finish_reason is None for chunk in received)
    assert cluster.metric("tpserve:kv_cache_free_blocks") < cluster.metric("tpserve:kv_cache_total_blocks")
    stream.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    wait_all_blocks_free(cluster)
