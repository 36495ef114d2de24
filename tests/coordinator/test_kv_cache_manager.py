"""The KV-cache manager on its own (coordinator/kv_cache_manager.py): block tables over the pool,
prefix look-ups that leave the last token to compute, namespaces that share nothing, hit counts,
and a reset that tells the KV-event listener. The scheduler's use of it: test_prefix_caching.py."""

from __future__ import annotations

import hashlib
from array import array

from coordinator.block_allocator import BlockAllocator
from coordinator.kv_cache_manager import KVCacheManager, extend_block_hashes
from coordinator.kv_events import KvEventLog
from coordinator.sequence import Sequence, StopParams
from tpserve.step import SamplingParams

BLOCK_SIZE = 4


def _seq(seq_id: int, tokens: list[int], namespace: bytes = b"", **sampling) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(**sampling), StopParams(max_tokens=8), max_model_len=64,
                    cache_namespace=namespace)


def _computed(manager: KVCacheManager, seq: Sequence) -> None:
    """Admits ``seq`` with its cached prefix and computes the rest of its prompt (as a step would)."""
    cached = manager.cached_prefix(seq)
    manager.take_cached_prefix(seq, cached)
    assert manager.grow(seq, seq.num_tokens - seq.num_computed_tokens) is not None
    manager.cache_full_blocks(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens


def test_block_hashes_chain_sha256_from_the_namespace() -> None:
    seq = _seq(0, list(range(10)), namespace=b"n" * 32)
    hashes = extend_block_hashes(seq, BLOCK_SIZE, 10)
    first = hashlib.sha256(b"n" * 32 + array("q", [0, 1, 2, 3]).tobytes()).digest()
    assert hashes == [first, hashlib.sha256(first + array("q", [4, 5, 6, 7]).tobytes()).digest()]


def test_a_second_sequence_takes_the_cached_blocks_but_computes_its_last_token() -> None:
    manager = KVCacheManager(BlockAllocator(16, BLOCK_SIZE), enable_prefix_caching=True)
    first = _seq(0, list(range(12)))
    _computed(manager, first)
    same = _seq(1, list(range(12)))
    cached = manager.cached_prefix(same)
    assert cached == first.block_ids[:2]  # 3 full blocks, but the last token's logits are needed
    assert manager.num_blocks_to_admit(same, cached) == 1  # held cached blocks use up no free block
    manager.take_cached_prefix(same, cached)
    assert (same.num_computed_tokens, same.num_cached_prompt_tokens) == (8, 8)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (12 + 12, 8)
    manager.allocator.check_invariants([first.block_ids, same.block_ids])



def test_a_continuation_counts_its_given_tokens_hit_as_cached_prompt_tokens() -> None:
    """A continued request (another replica's output given as ``generated_token_ids``) is prompt for usage:
    a prefix hit over its given tokens counts whole blocks of them, not only of its prompt (which was 7
    of a 47-token usage prompt whose 32-token hit the metrics counted)."""
    manager = KVCacheManager(BlockAllocator(16, BLOCK_SIZE), enable_prefix_caching=True)
    _computed(manager, _seq(0, list(range(14))))
    continued = Sequence(1, list(range(3)), SamplingParams(), StopParams(max_tokens=8), max_model_len=64,
                         output_token_ids=list(range(3, 14)))  # 3 prompt tokens, 11 given
    manager.take_cached_prefix(continued, manager.cached_prefix(continued))
    assert continued.num_usage_prompt_tokens == 14
    assert (continued.num_computed_tokens, continued.num_cached_prompt_tokens) == (12, 12)

def test_namespaces_and_prompt_logprobs_find_nothing() -> None:
    manager = KVCacheManager(BlockAllocator(16, BLOCK_SIZE), enable_prefix_caching=True)
    _computed(manager, _seq(0, list(range(12))))
    assert manager.cached_prefix(_seq(1, list(range(12)), namespace=b"t" * 32)) == []
    assert manager.cached_prefix(_seq(2, list(range(12)), prompt_logprobs=1)) == []
    assert KVCacheManager(BlockAllocator(16, BLOCK_SIZE)).cached_prefix(_seq(3, list(range(12)))) == []


def test_trim_free_and_reset_return_every_block_and_tell_the_listener() -> None:
    manager = KVCacheManager(BlockAllocator(8, BLOCK_SIZE), enable_prefix_caching=True)
    events = KvEventLog(BLOCK_SIZE)
    subscriber = events.subscribe()
    manager.allocator.listener = events
    seq = _seq(0, list(range(6)))
    _computed(manager, seq)  # one full block, cached; one partial
    assert manager.grow(seq, 8) == [2, 3] and len(seq.block_ids) == 4
    manager.trim(seq, 2)
    assert seq.block_ids == [0, 1] and manager.allocator.num_free_blocks == 6
    manager.free(seq)
    assert seq.block_ids == [] and manager.allocator.num_free_blocks == 8 and manager.allocator.is_cached(0)
    manager.reset()
    assert manager.allocator.listener is events and not manager.allocator.is_cached(0)
    batches = iter(lambda: events.read(subscriber), None)  # every batch recorded so far
    kinds = [event.WhichOneof("data") for batch in batches for event in batch.events]
    assert kinds == ["stored", "cleared"]
