"""The host tier's bookkeeping (coordinator/kv_host_tier.py) and its use by the KV-cache manager and the
scheduler, without a device: which evictions become copy orders, least-recently-used slots, namespaces,
the plan's copy columns, KV events per medium, and a flush or a group restart that forgets the tier."""

from __future__ import annotations

import random

import pytest

from coordinator.block_allocator import BlockAllocator
from coordinator.kv_cache_manager import KVCacheManager
from coordinator.kv_events import KvEventLog
from coordinator.kv_host_tier import HostTier
from coordinator.scheduler import Scheduler
from coordinator.sequence import FinishReason, Sequence, StopParams
from smg_grpc_proto.generated import common_pb2
from tests.coordinator.kv_checker import EOS, KVChecker, make_seq, run_step
from tpserve.step import SamplingParams, StepPlan
from tpserve.step_pb import plan_from_pb, plan_to_pb
from tpserve.v1 import worker_pb2 as pb

BLOCK_SIZE = 4
H = [bytes([i]) * 32 for i in range(8)]


def _seq(seq_id: int, tokens: list[int], namespace: bytes = b"") -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(), StopParams(max_tokens=8), max_model_len=64,
                    cache_namespace=namespace)


def _computed(manager: KVCacheManager, seq: Sequence) -> None:
    manager.take_cached_prefix(seq, manager.cached_prefix(seq))
    assert manager.grow(seq, seq.num_tokens - seq.num_computed_tokens) is not None
    manager.cache_full_blocks(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens


def test_slots_are_reused_least_recently_used_first_but_never_one_read_by_the_plan_being_built() -> None:
    tier = HostTier(2, BLOCK_SIZE)
    tier.store(5, H[0], b"")
    tier.store(6, H[1], b"")
    tier.store(9, H[0], b"")  # already here: touched, no copy
    assert tier.take_orders() == (((5, 0), (6, 1)), ())
    tier.load(1, 3)  # H[1] read: most recently used, and pinned until the plan is taken
    tier.store(7, H[2], b"")  # evicts H[0] (least recently used)
    assert tier.lookup(H[0], b"") is None and tier.lookup(H[2], b"") == 0 and tier.num_evictions == 1
    tier.load(0, 4)
    tier.store(8, H[3], b"")  # both slots are read by this plan: the block is not kept
    assert tier.lookup(H[3], b"") is None
    assert tier.take_orders() == (((7, 0),), ((1, 3), (0, 4)))
    tier.store(8, H[3], b"")  # a new plan: slots read before are ordinary again
    assert tier.lookup(H[3], b"") == 1 and (tier.num_hits, tier.num_stores, tier.num_evictions) == (2, 4, 2)
    tier.check_invariants()
    with pytest.raises(ValueError, match="host slot 1 loaded but empty"):
        HostTier(2, BLOCK_SIZE).load(1, 0)
    with pytest.raises(ValueError, match="must be positive"):
        HostTier(0, BLOCK_SIZE)


def test_one_plan_never_names_a_slot_twice_and_a_slot_found_is_kept_for_its_copy() -> None:
    tier = HostTier(2, BLOCK_SIZE)
    for block_id, block_hash in enumerate(H[:3]):  # a plan evicting more blocks than the tier holds
        tier.store(block_id, block_hash, b"")
    swap_out, _ = tier.take_orders()
    assert swap_out == ((0, 0), (1, 1))  # the third is not kept: both slots are this plan's destinations
    slot = tier.lookup(H[0], b"")  # least recently used, and about to be loaded:
    tier.pin(slot)  # the block it goes into may evict a device block into the tier first
    tier.store(7, H[5], b"")
    assert tier.lookup(H[0], b"") == slot and tier.lookup(H[1], b"") is None and tier.lookup(H[5], b"") == 1
    tier.load(slot, 3)
    assert tier.take_orders() == (((7, 1),), ((0, 3),))
    tier.check_invariants()


def test_a_slot_answers_only_its_own_namespace() -> None:
    tier = HostTier(4, BLOCK_SIZE)
    tier.store(1, H[0], b"a" * 32)
    assert tier.lookup(H[0], b"a" * 32) == 0
    assert tier.lookup(H[0], b"b" * 32) is None and tier.lookup(H[0], b"") is None


def test_evicted_blocks_go_to_the_tier_and_come_back_into_fresh_blocks_before_the_uncached_rest() -> None:
    allocator = BlockAllocator(4, BLOCK_SIZE)
    manager = KVCacheManager(allocator, enable_prefix_caching=True, host_tier=HostTier(40, BLOCK_SIZE))
    first = _seq(0, list(range(13)))  # 3 full blocks
    _computed(manager, first)
    a_blocks = list(first.block_ids)
    manager.free(first)
    other = _seq(1, list(range(100, 113)))
    _computed(manager, other)  # 4 blocks: the free one, then evicts first's blocks, last ones first
    swap_out, swap_in = manager.take_copy_orders()
    assert swap_out == ((a_blocks[2], 0), (a_blocks[1], 1), (a_blocks[0], 2)) and swap_in == ()
    manager.free(other)
    again = _seq(2, list(range(13)))
    cached = manager.cached_prefix(again)
    assert cached == []  # the pool holds none of it any more
    assert manager.num_blocks_to_admit(again, cached) == 4
    manager.take_cached_prefix(again, cached)
    swap_out, swap_in = manager.take_copy_orders()
    # Three hits copied into fresh blocks: other's uncached last block, then two of its cached ones, which the
    # pool evicts (to the tier too: copied out before the copies in overwrite them).
    assert [slot for slot, _ in swap_in] == [2, 1, 0] and [b for _, b in swap_in] == again.block_ids
    assert swap_out == ((again.block_ids[1], 3), (again.block_ids[2], 4))
    assert (again.num_computed_tokens, again.num_cached_prompt_tokens) == (12, 12)
    assert manager.host_tier_hits == 12 and manager.prefix_cache_hits == 12
    assert all(allocator.is_cached(b) for b in again.block_ids)
    allocator.check_invariants([again.block_ids])
    manager.host_tier.check_invariants()


def test_a_tier_needs_prefix_caching_and_the_pools_block_size() -> None:
    with pytest.raises(ValueError, match="needs --enable-prefix-caching"):
        KVCacheManager(BlockAllocator(4, BLOCK_SIZE), host_tier=HostTier(8, BLOCK_SIZE))
    with pytest.raises(ValueError, match="block_size 8"):
        KVCacheManager(BlockAllocator(4, BLOCK_SIZE), True, host_tier=HostTier(8, 8))


def test_the_plan_carries_the_copies_as_columns_and_a_plan_not_sent_hands_them_to_the_next() -> None:
    plan = StepPlan(3, kv_swap_out=((5, 0), (6, 9)), kv_swap_in=((9, 2),))
    msg = plan_to_pb(plan)
    assert list(msg.kv_copies.swap_out_block_ids) == [5, 6] and list(msg.kv_copies.swap_out_slots) == [0, 9]
    assert plan_from_pb(pb.StepPlan.FromString(msg.SerializeToString())) == plan
    assert not plan_to_pb(StepPlan(4)).HasField("kv_copies")  # nothing on the wire without copies
    with pytest.raises(ValueError, match="malformed host-tier copies"):
        plan_from_pb(pb.StepPlan(step_id=1, kv_copies=pb.KvTierCopies(swap_out_block_ids=[1])))
    scheduler = Scheduler(BlockAllocator(8, BLOCK_SIZE), 4, 64, enable_prefix_caching=True,
                          host_tier=HostTier(16, BLOCK_SIZE))
    scheduler.take_back(plan)
    nxt = scheduler.schedule()
    assert (nxt.kv_swap_out, nxt.kv_swap_in) == (plan.kv_swap_out, plan.kv_swap_in)


def test_kv_events_name_the_tier_of_every_block() -> None:
    allocator = BlockAllocator(3, BLOCK_SIZE)
    manager = KVCacheManager(allocator, enable_prefix_caching=True, host_tier=HostTier(4, BLOCK_SIZE))
    events = KvEventLog(BLOCK_SIZE)
    manager.attach_listener(events)
    subscriber = events.subscribe()
    first = _seq(0, list(range(9)), namespace=b"n" * 32)
    _computed(manager, first)
    manager.free(first)
    _computed(manager, _seq(1, list(range(50, 59))))  # evicts first's two blocks to the tier
    batch = events.read(subscriber)
    kinds = [(e.WhichOneof("data"), getattr(e, e.WhichOneof("data")).medium) for e in batch.events]
    assert kinds == [("stored", "GPU"), ("stored", "GPU"), ("removed", "GPU"), ("stored", "CPU"),
                     ("removed", "GPU"), ("stored", "CPU"), ("stored", "GPU"), ("stored", "GPU")]
    host = batch.events[3].stored
    assert host.tier == common_pb2.KV_CACHE_TIER_HOST and host.cache_salt == (b"n" * 32).hex()
    assert batch.events[0].stored.tier == common_pb2.KV_CACHE_TIER_DEVICE
    assert manager.flush() == 0  # the second sequence still holds its blocks
    flushed = events.read(subscriber).events
    assert [(e.WhichOneof("data"), e.removed.medium) for e in flushed] == [("removed", "CPU")] * 2
    assert manager.host_tier.num_used_slots == 0


def test_without_a_tier_events_carry_no_medium_and_a_restart_empties_the_tier() -> None:
    allocator = BlockAllocator(2, BLOCK_SIZE)
    plain = KVCacheManager(allocator, enable_prefix_caching=True)
    events = KvEventLog(BLOCK_SIZE)
    plain.attach_listener(events)
    subscriber = events.subscribe()
    _computed(plain, _seq(0, list(range(5))))
    (event,) = events.read(subscriber).events
    assert not event.stored.HasField("medium") and not event.stored.HasField("tier")
    tiered = KVCacheManager(BlockAllocator(2, BLOCK_SIZE), True, host_tier=HostTier(4, BLOCK_SIZE))
    tiered.host_tier.store(0, H[0], b"")
    tiered.reset()
    assert tiered.host_tier.num_used_slots == 0 and tiered.take_copy_orders() == ((), ())
    assert tiered.allocator.on_evict is not None  # the new pool still feeds the tier


def test_the_tiers_size_is_vllms_gib_summed_over_the_ranks_or_the_override() -> None:
    from coordinator.kv_host_tier import GIB, num_host_slots

    assert num_host_slots(None, None, [32768, 32768]) == 0  # off
    assert num_host_slots(1.0, None, [32768]) == GIB // 32768 == 32768
    assert num_host_slots(1.0, None, [32768, 40000]) == (GIB // 2) // 40000  # half each, the larger block
    assert num_host_slots(1.0, 7, [32768]) == 7  # the override wins
    with pytest.raises(ValueError, match="holds no KV block of 65536 bytes"):
        num_host_slots(1e-5, None, [65536])
    with pytest.raises(ValueError, match="more than 2147483647"):
        num_host_slots(None, 2**31, [1])


def test_the_flags_need_prefix_caching() -> None:
    from tpserve.config import CacheConfig

    assert not CacheConfig().host_tier_on
    assert CacheConfig(kv_offloading_size=2.5).host_tier_on and CacheConfig(num_cpu_blocks_override=8).host_tier_on
    with pytest.raises(ValueError, match="need --enable-prefix-caching"):
        CacheConfig(kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(ValueError):
        CacheConfig(kv_offloading_size=0)


class TieredKVChecker(KVChecker):
    """The simulated KV cache of test_prefix_caching.py with host slots: each plan's copies out, then in,
    before its chunks (tpserve/step.py's order); a chunk then reads what the copies brought."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        super().__init__(num_blocks, block_size)
        self.host: list[list | None] = [None] * num_slots

    def apply(self, plan: StepPlan, seqs: dict[int, Sequence]) -> None:
        assert len({slot for _, slot in plan.kv_swap_out}) == len(plan.kv_swap_out), "a slot written twice"
        for block_id, slot in plan.kv_swap_out:
            self.host[slot] = list(self.slots[block_id])
        for slot, block_id in plan.kv_swap_in:
            assert self.host[slot] is not None, f"slot {slot} read before written"
            self.slots[block_id] = list(self.host[slot])
        super().apply(plan, seqs)


@pytest.mark.parametrize("num_slots", [3, 200])
def test_random_workload_through_the_tier_reads_only_its_own_kv(num_slots: int) -> None:
    rng = random.Random(num_slots)
    num_blocks, block_size = 24, 4
    scheduler = Scheduler(BlockAllocator(num_blocks, block_size), max_num_seqs=6, max_num_batched_tokens=48,
                          enable_prefix_caching=True, check_writes=True, host_tier=HostTier(num_slots, block_size))
    checker = TieredKVChecker(num_blocks, block_size, num_slots)
    prefixes = [[rng.randint(3, 50) for _ in range(rng.randint(4, 24))] for _ in range(8)]
    seqs: dict[int, Sequence] = {}
    for _ in range(600):
        if rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randint(3, 50) for _ in range(rng.randint(0, 10))]
            seq = make_seq(len(seqs), prompt, max_tokens=rng.randint(1, 30), max_model_len=64)
            seqs[seq.seq_id] = seq
            scheduler.add(seq)
        if seqs and rng.random() < 0.05:
            scheduler.finish(rng.choice(list(seqs.values())), FinishReason.ABORT)
        if scheduler.has_work():
            run_step(scheduler, checker, seqs, token=EOS if rng.random() < 0.03 else rng.choice([7, 8]))
            scheduler.kv_cache.host_tier.check_invariants()
    while scheduler.has_work():
        run_step(scheduler, checker, seqs)
    tier = scheduler.kv_cache.host_tier
    assert all(seq.is_finished for seq in seqs.values()) and scheduler.allocator.num_free_blocks == num_blocks
    assert scheduler.num_preemptions > 0 and tier.num_stores > 0 and tier.num_hits > 0
    assert tier.num_evictions > 0  # full tiers (3 slots: within plans too) kept every copy consistent
