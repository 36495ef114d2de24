"""Automatic prefix caching in the block allocator and the scheduler: pure Python, no torch.

A simulated worker (``KVChecker``, tests/coordinator/kv_checker.py) applies every plan as a rank does (drop, register,
extend block tables) and keeps, per KV slot, the tokens whose K/V it holds: every
position a chunk attends to must hold exactly its sequence's tokens up to there, so a
cached block handed to the wrong sequence, or overwritten while shared, fails the test.
"""

from __future__ import annotations

import random

import pytest

from coordinator.block_allocator import BlockAllocator
from coordinator.cache_isolation import prefix_cache_namespace, tenant_id
from coordinator.scheduler import Scheduler
from coordinator.kv_cache_manager import extend_block_hashes
from coordinator.sequence import FinishReason, Sequence
from tests.coordinator.kv_checker import EOS, KVChecker, make_seq, run_step


def test_block_hashes_chain_every_token_before_the_block() -> None:
    a, b = make_seq(0, list(range(40))), make_seq(1, list(range(40)))
    c = make_seq(2, [99] + list(range(1, 40)))  # differs in block 0 only
    ha, hb, hc = (extend_block_hashes(s, 16, 40) for s in (a, b, c))
    assert len(ha) == 2 and ha == hb
    assert ha[0] != hc[0] and ha[1] != hc[1]  # block 1's tokens are equal; its history is not


def test_allocator_shares_cached_blocks_and_evicts_least_recently_freed_only_when_needed() -> None:
    allocator = BlockAllocator(4, block_size=4)
    first = allocator.allocate(2)
    allocator.cache(first[0], b"h0")
    allocator.cache(first[1], b"h1")
    assert allocator.lookup([b"h0", b"h1", b"h2"]) == first and allocator.lookup([b"h1"]) == [first[1]]
    allocator.acquire(first)  # a second sequence shares both
    assert allocator.ref_count(first[0]) == 2
    allocator.check_invariants([first, first])
    allocator.free(reversed(first))
    allocator.free(reversed(first))
    assert allocator.num_free_blocks == 4 and allocator.lookup([b"h0", b"h1"]) == first  # still cached
    allocator.check_invariants([])
    other = allocator.allocate(2)  # the two uncached blocks go first
    assert set(other).isdisjoint(first) and allocator.num_evictions == 0
    (evicted,) = allocator.allocate(1)  # then the least recently freed cached block: the last one of the table
    assert evicted == first[1] and allocator.lookup([b"h0", b"h1"]) == [first[0]] and allocator.num_evictions == 1
    allocator.check_invariants([other, [evicted]])
    allocator.cache(evicted, b"h0")  # the hash is taken by first[0]: stays uncached
    assert not allocator.is_cached(evicted)
    with pytest.raises(ValueError, match="not cached"):
        allocator.acquire([other[0]])
    with pytest.raises(ValueError, match="cached while free"):
        allocator.cache(first[0], b"h9")


def test_second_request_prefills_only_past_the_shared_blocks() -> None:
    block_size = 16
    scheduler = Scheduler(BlockAllocator(64, block_size), max_num_seqs=8, max_num_batched_tokens=512,
                          enable_prefix_caching=True, check_writes=True)
    checker = KVChecker(64, block_size)
    prefix = list(range(100, 300))  # 200 tokens: 12 full blocks (192 tokens) and 8 more
    first, second = make_seq(0, prefix + [5, 6, 7]), make_seq(1, prefix + [8, 9])
    seqs = {0: first, 1: second}
    scheduler.add(first)
    plan = run_step(scheduler, checker, seqs)
    assert plan.scheduled[0].start_position == 0 and plan.scheduled[0].num_tokens == 203
    assert first.num_cached_prompt_tokens == 0
    scheduler.add(second)
    plan = run_step(scheduler, checker, seqs)
    decode, prefill = plan.scheduled
    assert decode.seq_id == 0 and decode.num_tokens == 1
    assert prefill.seq_id == 1 and prefill.start_position == 192
    assert prefill.token_ids == tuple(prefix[192:] + [8, 9]) and prefill.sample
    assert prefill.new_block_ids[:12] == tuple(first.block_ids[:12]) and len(prefill.new_block_ids) == 13
    assert prefill.new_block_ids[12] not in first.block_ids
    assert second.num_cached_prompt_tokens == 192
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (203 + 202, 192)
    assert all(scheduler.allocator.ref_count(b) == 2 for b in first.block_ids[:12])


def test_an_identical_prompt_still_computes_its_last_token() -> None:
    scheduler = Scheduler(BlockAllocator(8, 4), max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True,
                          check_writes=True)
    checker = KVChecker(8, 4)
    seqs = {0: make_seq(0, list(range(10, 18)), max_tokens=1), 1: make_seq(1, list(range(10, 18)))}
    scheduler.add(seqs[0])
    run_step(scheduler, checker, seqs)  # finishes: its two full blocks stay cached, unheld
    assert scheduler.allocator.num_free_blocks == 8
    scheduler.add(seqs[1])
    plan = run_step(scheduler, checker, seqs)
    (chunk,) = plan.scheduled
    assert chunk.start_position == 4 and chunk.token_ids == (14, 15, 16, 17)  # block 1 is recomputed, not shared


def test_namespaces_share_no_block_hash_and_no_hit() -> None:
    """Issue 20, fault 1: tenant B (or another cache_salt) must not find tenant A's blocks."""
    tokens = list(range(100, 140))
    namespaces = {"anonymous": b"", "a": prefix_cache_namespace("a", ""), "b": prefix_cache_namespace("b", ""),
                  "a+salt": prefix_cache_namespace("a", "s1"), "a+salt2": prefix_cache_namespace("a", "s2"),
                  "salt only": prefix_cache_namespace("", "s1")}
    assert namespaces["a"] == prefix_cache_namespace("a", "") and prefix_cache_namespace("ab", "c") != \
        prefix_cache_namespace("a", "bc")
    chains = {}
    for name, namespace in namespaces.items():
        seq = make_seq(0, tokens)
        seq.cache_namespace = namespace
        chains[name] = extend_block_hashes(seq, 16, 40)
    for i, first in enumerate(chains.values()):  # the namespace is in block 0: every block of a chain differs
        for second in list(chains.values())[i + 1:]:
            assert all(x != y for x, y in zip(first, second, strict=True))

    block_size = 16
    scheduler = Scheduler(BlockAllocator(32, block_size), max_num_seqs=4, max_num_batched_tokens=256,
                          enable_prefix_caching=True, check_writes=True)
    checker = KVChecker(32, block_size)
    seqs: dict[int, Sequence] = {}

    def cached_tokens(namespace: str) -> int:
        seq = make_seq(len(seqs), tokens, max_tokens=1)
        seq.cache_namespace = namespaces[namespace]
        seqs[seq.seq_id] = seq
        scheduler.add(seq)
        while scheduler.has_work():
            run_step(scheduler, checker, seqs)
        return seq.num_cached_prompt_tokens

    assert cached_tokens("a") == 0
    assert cached_tokens("b") == 0  # another tenant: a miss, although A's blocks are cached
    assert cached_tokens("a+salt") == 0 and cached_tokens("anonymous") == 0 and cached_tokens("salt only") == 0
    assert cached_tokens("a") == 32  # A's own repeat hits its two full blocks
    assert cached_tokens("b") == 32 and cached_tokens("a+salt") == 32  # each namespace finds its own
    assert cached_tokens("a+salt2") == 0


def test_tenant_ids_come_from_the_bearer_key_and_never_spell_it() -> None:
    key = "tenant-a-secret-key"
    ids = {tenant_id([("authorization", value)]) for value in (f"Bearer {key}", f"bearer {key}", f" Bearer  {key} ",
                                                                f"Bearer {key}".encode())}
    assert len(ids) == 1
    (tenant,) = ids
    assert len(tenant) == 16 and key not in tenant
    assert tenant_id([("authorization", "Bearer another-key")]) not in {tenant, ""}
    assert tenant_id([]) == tenant_id(None) == tenant_id([("authorization", "Basic abc")]) == ""


def test_validation_puts_tenant_and_cache_salt_into_the_namespace() -> None:
    from coordinator.errors import InvalidArgumentError
    from coordinator.tokenizer import Tokenizer
    from coordinator.validation import validate_request
    from tpserve.embedded_model import default_model_dir
    from tpserve.v1 import generate_pb2 as pb

    tokenizer = Tokenizer.from_pretrained(default_model_dir())

    def namespace(tenant: str = "", **fields) -> bytes:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 5, 6]), **fields)
        return validate_request(request, tokenizer, 1024, 512, tenant).cache_namespace

    assert namespace() == b""  # anonymous and unsalted: the chain of a server without keys, as before
    assert namespace("a") == prefix_cache_namespace("a", "") != namespace("b")
    assert namespace("a", cache_salt="x") == prefix_cache_namespace("a", "x") != namespace("a")
    assert namespace(cache_salt="x") not in {b"", namespace("a", cache_salt="x")}
    for bad in ("", "x" * 257):
        with pytest.raises(InvalidArgumentError, match="cache_salt is .* characters; it must have 1 to 256"):
            namespace(cache_salt=bad)


def test_off_means_no_sharing() -> None:
    scheduler = Scheduler(BlockAllocator(16, 4), max_num_seqs=4, max_num_batched_tokens=64, check_writes=True)
    checker = KVChecker(16, 4)
    seqs = {0: make_seq(0, list(range(10, 22))), 1: make_seq(1, list(range(10, 22)))}
    scheduler.add(seqs[0])
    run_step(scheduler, checker, seqs)
    scheduler.add(seqs[1])
    plan = run_step(scheduler, checker, seqs)
    assert plan.scheduled[1].start_position == 0 and scheduler.prefix_cache_queries == 0


def test_abort_and_preemption_release_only_their_own_references() -> None:
    # 6 blocks of 2: two sequences share a 4-token prefix (2 blocks); decodes run out of blocks.
    scheduler = Scheduler(BlockAllocator(6, 2), max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True,
                          check_writes=True)
    checker = KVChecker(6, 2)
    seqs = {0: make_seq(0, [10, 11, 12, 13, 14], max_tokens=6), 1: make_seq(1, [10, 11, 12, 13, 15], max_tokens=6)}
    scheduler.add(seqs[0])
    run_step(scheduler, checker, seqs)
    scheduler.add(seqs[1])
    run_step(scheduler, checker, seqs)
    shared = seqs[0].block_ids[:2]
    assert seqs[1].block_ids[:2] == shared and scheduler.allocator.ref_count(shared[0]) == 2
    while not scheduler.num_preemptions:
        run_step(scheduler, checker, seqs)
    assert seqs[1].num_preemptions == 1 and scheduler.allocator.ref_count(shared[0]) == 1  # seq 0 keeps them
    scheduler.finish(seqs[0], FinishReason.ABORT)
    scheduler.check_invariants()
    while scheduler.has_work():
        run_step(scheduler, checker, seqs)
    assert seqs[1].is_finished and scheduler.allocator.num_free_blocks == 6


def test_random_workload_with_shared_prefixes_keeps_every_invariant() -> None:
    rng = random.Random(0)
    num_blocks, block_size = 24, 4
    scheduler = Scheduler(BlockAllocator(num_blocks, block_size), max_num_seqs=6, max_num_batched_tokens=48,
                          enable_prefix_caching=True, check_writes=True)
    checker = KVChecker(num_blocks, block_size)
    prefixes = [[rng.randint(3, 50) for _ in range(rng.randint(4, 24))] for _ in range(4)]
    seqs: dict[int, Sequence] = {}
    for _ in range(600):
        if rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randint(3, 50) for _ in range(rng.randint(0, 10))]
            seq = make_seq(len(seqs), prompt, max_tokens=rng.randint(1, 30), max_model_len=64)
            seqs[seq.seq_id] = seq
            scheduler.add(seq)
        if seqs and rng.random() < 0.05:
            scheduler.finish(rng.choice(list(seqs.values())), FinishReason.ABORT)
            scheduler.check_invariants()
        if scheduler.has_work():
            run_step(scheduler, checker, seqs, token=EOS if rng.random() < 0.03 else rng.choice([7, 8]))
    while scheduler.has_work():
        run_step(scheduler, checker, seqs)
    assert all(seq.is_finished for seq in seqs.values())
    assert scheduler.allocator.num_free_blocks == num_blocks
    assert scheduler.num_preemptions > 0 and scheduler.allocator.num_evictions > 0
    assert scheduler.prefix_cache_hits > 0.3 * scheduler.prefix_cache_queries
