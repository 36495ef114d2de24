"""The prefix cache's host tier under the real scheduler and model runner (one process, stories260k, greedy):

- a working set that does not fit the device pool (24 blocks) but fits the tier (240) gets prefix hits on
  its second round, every cached prompt token the ideal (all but the block holding the last token), and
  the same tokens as an unbounded pool; without the tier the same pool finds nothing;
- preemption by swap gives the same tokens as preemption by recompute and as an unbounded pool;
- a block in the tier is never served to another namespace;
- the 8-bit cache, the latent (MLA) cache and a draft model's cache (float or 8-bit) come back from the tier
  as they went.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordinator.block_allocator import BlockAllocator
from coordinator.kv_host_tier import HostTier
from coordinator.scheduler import Scheduler
from coordinator.sequence import Sequence, StopParams
from tests.paths import requires_stories
from tests.tiny_models import save_servable_model
from tests.worker.deepseek_v3_specs import Q_LORA
from tpserve.step import SamplingParams
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

pytestmark = requires_stories

BLOCK_SIZE = 4
POOL = 24  # device blocks: two of the working set's prompts at a time
TIER = 240  # host slots: ten times the pool
UNBOUNDED = 512
PROMPT_LEN = 37  # 9 full blocks before the last token: the ideal hit is 36 tokens
NUM_NEW = 4
WORKING_SET = [[1] + [(7 * i + 13 * j) % 500 + 3 for j in range(PROMPT_LEN - 1)] for i in range(6)]


def _runner(model_dir: Path, num_blocks: int, num_host_blocks: int = 0, kv_cache_dtype: str = "auto") -> ModelRunner:
    runner = ModelRunner(model_dir, ParallelContext.single(), torch.float32, block_size=BLOCK_SIZE,
                         kv_cache_dtype=kv_cache_dtype)
    runner.init_kv_cache(num_blocks, num_host_blocks=num_host_blocks)
    return runner


def _scheduler(num_blocks: int, num_host_blocks: int = 0, max_num_seqs: int = 8) -> Scheduler:
    tier = HostTier(num_host_blocks, BLOCK_SIZE) if num_host_blocks else None
    return Scheduler(BlockAllocator(num_blocks, BLOCK_SIZE), max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                     enable_prefix_caching=True, check_writes=True, host_tier=tier)


def _run(scheduler: Scheduler, runner: ModelRunner, prompts: list[list[int]], first_id: int = 0,
         namespace: bytes = b"", num_new: int = NUM_NEW) -> list[Sequence]:
    """Adds ``prompts`` together and steps until they finish; checks the invariants after every step."""
    seqs = [Sequence(first_id + i, list(p), SamplingParams(temperature=0.0), StopParams(num_new, frozenset()), 256,
                     cache_namespace=namespace) for i, p in enumerate(prompts)]
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_work():
        plan = scheduler.schedule()
        scheduler.update(plan, runner.execute(plan))
        scheduler.check_invariants()
        if scheduler.kv_cache.host_tier is not None:
            scheduler.kv_cache.host_tier.check_invariants()
    return seqs


def _two_rounds(model_dir: Path, num_blocks: int, num_host_blocks: int) -> tuple[list[list[int]], list[int], Scheduler]:
    """The working set one prompt at a time, twice: every output, and the second round's cached prompt tokens."""
    scheduler, runner = _scheduler(num_blocks, num_host_blocks), _runner(model_dir, num_blocks, num_host_blocks)
    outputs, cached = [], []
    for round_ in range(2):
        for i, prompt in enumerate(WORKING_SET):
            (seq,) = _run(scheduler, runner, [prompt], first_id=100 * round_ + i)
            outputs.append(seq.output_token_ids)
            if round_:
                cached.append(seq.num_cached_prompt_tokens)
    return outputs, cached, scheduler


def test_a_working_set_beyond_the_pool_hits_in_the_tier_with_the_unbounded_pools_tokens(stories_dir: Path) -> None:
    reference, reference_cached, _ = _two_rounds(stories_dir, UNBOUNDED, 0)
    assert reference_cached == [36] * 6  # the ideal: the unbounded pool keeps everything
    tiered, cached, scheduler = _two_rounds(stories_dir, POOL, TIER)
    assert tiered == reference
    assert all(c >= 36 - BLOCK_SIZE for c in cached) and cached == [36] * 6, cached  # within one block of ideal
    tier = scheduler.kv_cache.host_tier
    assert tier is not None and tier.num_hits >= 6 * 8 and tier.num_evictions == 0
    assert scheduler.kv_cache.host_tier_hits == BLOCK_SIZE * tier.num_hits
    assert tier.num_stores >= 6 * 9  # every prompt's blocks were evicted from the pool once
    _, untiered_cached, _ = _two_rounds(stories_dir, POOL, 0)
    assert untiered_cached == [0] * 6  # the same pool alone has evicted them all


def test_preemption_by_swap_gives_the_tokens_of_recompute(stories_dir: Path) -> None:
    prompts = [p[:13] for p in WORKING_SET[:5]]
    results = {}
    for name, num_blocks, num_host_blocks in (("unbounded", UNBOUNDED, 0), ("recompute", 16, 0), ("swap", 16, 160)):
        scheduler = _scheduler(num_blocks, num_host_blocks)
        seqs = _run(scheduler, _runner(stories_dir, num_blocks, num_host_blocks), prompts, num_new=24)
        results[name] = ([s.output_token_ids for s in seqs], scheduler)
    assert results["swap"][0] == results["recompute"][0] == results["unbounded"][0]
    assert results["recompute"][1].num_preemptions > 0 and results["swap"][1].num_preemptions > 0
    swap = results["swap"][1]
    assert swap.kv_cache.host_tier is not None and swap.kv_cache.host_tier.num_hits > 0  # readmissions copied in
    assert swap.prefix_cache_hits > results["recompute"][1].prefix_cache_hits


def test_a_block_in_the_tier_is_never_served_to_another_namespace(stories_dir: Path) -> None:
    scheduler, runner = _scheduler(POOL, TIER), _runner(stories_dir, POOL, TIER)
    tenant_a, tenant_b = b"a" * 32, b"b" * 32
    (first,) = _run(scheduler, runner, [WORKING_SET[0]], namespace=tenant_a)
    _run(scheduler, runner, WORKING_SET[1:4], first_id=10, namespace=tenant_a)  # push it out of the pool
    assert scheduler.allocator.lookup(first.block_hashes[:1]) == []
    tier = scheduler.kv_cache.host_tier
    assert tier is not None and tier.lookup(first.block_hashes[0], tenant_a) is not None
    assert tier.lookup(first.block_hashes[0], tenant_b) is None  # even under the very hash
    hits = tier.num_hits
    (other,) = _run(scheduler, runner, [WORKING_SET[0]], first_id=20, namespace=tenant_b)
    assert other.num_cached_prompt_tokens == 0 and tier.num_hits == hits
    (unsalted,) = _run(scheduler, runner, [WORKING_SET[0]], first_id=21)
    assert unsalted.num_cached_prompt_tokens == 0 and tier.num_hits == hits
    (again,) = _run(scheduler, runner, [WORKING_SET[0]], first_id=22, namespace=tenant_a)
    assert again.num_cached_prompt_tokens == 36 and tier.num_hits > hits
    assert other.output_token_ids == unsalted.output_token_ids == again.output_token_ids == first.output_token_ids


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_the_8bit_cache_comes_back_from_the_tier_as_it_went(stories_dir: Path, kv_cache_dtype: str) -> None:
    runs = {}
    # A pool of 32 blocks (128 tokens) at least: the calibration prompt's length, so both runs share their scales.
    for num_blocks, num_host_blocks in ((UNBOUNDED, 0), (32, TIER)):
        scheduler = _scheduler(num_blocks, num_host_blocks)
        runner = _runner(stories_dir, num_blocks, num_host_blocks, kv_cache_dtype)
        seqs = [_run(scheduler, runner, [p], first_id=10 * r + i)[0] for r in range(2) for i, p in enumerate(WORKING_SET)]
        runs[num_host_blocks] = [s.output_token_ids for s in seqs], [s.num_cached_prompt_tokens for s in seqs[6:]]
        if num_host_blocks:
            assert scheduler.kv_cache.host_tier is not None and scheduler.kv_cache.host_tier.num_hits >= 6 * 8
    assert runs[TIER] == runs[0]  # same tokens, and the same 36 cached tokens, from the tier as from the pool
    assert runs[TIER][1] == [36] * 6


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_latent_attention_blocks_come_back_from_the_tier(stories_dir: Path, tmp_path: Path, kv_cache_dtype: str) -> None:
    """The latent cache's blocks, and an 8-bit latent cache's scale pools with them."""
    model_dir = save_servable_model(Q_LORA, tmp_path / Q_LORA.name, stories_dir)
    outputs = {}
    for num_blocks, num_host_blocks in ((UNBOUNDED, 0), (POOL, TIER)):
        scheduler = _scheduler(num_blocks, num_host_blocks)
        runner = _runner(model_dir, num_blocks, num_host_blocks, kv_cache_dtype)
        seqs = [_run(scheduler, runner, [p], first_id=10 * r + i)[0]
                for r in range(2) for i, p in enumerate(WORKING_SET[:4])]
        outputs[num_host_blocks] = [s.output_token_ids for s in seqs], [s.num_cached_prompt_tokens for s in seqs[4:]]
        if num_host_blocks:
            assert scheduler.kv_cache.host_tier is not None and scheduler.kv_cache.host_tier.num_hits >= 4 * 8
    assert outputs[TIER] == outputs[0]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_draft_models_blocks_travel_with_the_targets(stories_dir: Path, kv_cache_dtype: str) -> None:
    """The draft's cache (the same block ids) has host slots beside the target's, an 8-bit cache's scale pools
    too: with stories260k drafting for itself every proposal is right only if the draft's K/V came back from the
    tier as well."""
    from coordinator.ngram_proposer import DraftModelProposer

    runs = {}
    # An 8-bit pool of 32 blocks at least: the calibration prompt's 128 tokens, so both runs share their offsets.
    pool = POOL if kv_cache_dtype == "auto" else 32
    for num_blocks, num_host_blocks in ((UNBOUNDED, 0), (pool, TIER)):
        runner = ModelRunner(stories_dir, ParallelContext.single(), torch.float32, block_size=BLOCK_SIZE,
                             draft_model_dir=stories_dir, kv_cache_dtype=kv_cache_dtype)
        runner.init_kv_cache(num_blocks, num_host_blocks=num_host_blocks)
        tier = HostTier(num_host_blocks, BLOCK_SIZE) if num_host_blocks else None
        scheduler = Scheduler(BlockAllocator(num_blocks, BLOCK_SIZE), max_num_seqs=8, max_num_batched_tokens=256,
                              enable_prefix_caching=True, check_writes=True, proposer=DraftModelProposer(3),
                              host_tier=tier)
        seqs = [_run(scheduler, runner, [p], first_id=10 * r + i, num_new=12)[0]
                for r in range(2) for i, p in enumerate(WORKING_SET[:4])]
        runs[num_host_blocks] = ([s.output_token_ids for s in seqs], [s.num_cached_prompt_tokens for s in seqs[4:]],
                                 scheduler.spec.num_accepted_tokens)
        if tier is not None:
            assert tier.num_hits >= 4 * 8
    assert runs[TIER] == runs[0]  # tokens, 36 cached tokens each, and every accepted proposal alike
    assert runs[0][1] == [36] * 4 and runs[0][2] > 0
