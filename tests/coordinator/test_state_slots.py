"""Hybrid models' state slots in the scheduler (coordinator/state_slots.py), torch-free.

:class:`StateChecker` plays the workers' state pool: each slot holds the tokens its state
summarises. Every chunk must continue from a state that summarises exactly the tokens before it
(a fresh slot at position 0, a restored checkpoint after a prefix hit), so a wrong restore, a
checkpoint saved at the wrong row, a slot shared by two live sequences or an evicted checkpoint
still used fails the test.
"""

from __future__ import annotations

import random

import pytest

from coordinator.block_allocator import BlockAllocator
from coordinator.scheduler import Scheduler
from coordinator.sequence import FinishReason, Sequence, StopParams
from coordinator.state_slots import StateSlots
from tpserve.step import SamplingParams, StepPlan, StepResult

BLOCK_SIZE = 4
EOS = 2


def make_seq(seq_id: int, prompt: list[int], max_tokens: int = 6) -> Sequence:
    return Sequence(seq_id, list(prompt), SamplingParams(temperature=0.0), StopParams(max_tokens, frozenset({EOS})), 1024)


class StateChecker:
    """The workers' state pool as token tuples: what each slot's state was computed from."""

    def __init__(self, num_slots: int) -> None:
        self.slots: list[tuple[int, ...] | None] = [None] * num_slots
        self.live: dict[int, int] = {}  # seq_id -> live slot
        self.num_restores = 0

    def apply(self, plan: StepPlan, seqs: dict[int, Sequence]) -> None:
        for seq_id in plan.finished_seq_ids:
            self.live.pop(seq_id, None)
        for new in plan.new_seqs:
            assert new.state_slot not in self.live.values(), f"live slot {new.state_slot} is held twice"
            self.live[new.seq_id] = new.state_slot
        for chunk in plan.scheduled:  # the runner zeroes fresh slots first, then restores
            if chunk.start_position == 0:
                self.slots[self.live[chunk.seq_id]] = ()
        for seq_id, slot in plan.restored_states:
            assert self.slots[slot] is not None, f"restores checkpoint {slot}, never saved"
            self.slots[self.live[seq_id]] = self.slots[slot]
            self.num_restores += 1
        marks: dict[int, list[tuple[int, int]]] = {}
        for seq_id, rows, slot in plan.state_checkpoints:
            marks.setdefault(seq_id, []).append((rows, slot))
        for chunk in plan.scheduled:
            seq, live = seqs[chunk.seq_id], self.live[chunk.seq_id]
            assert self.slots[live] == seq.token_ids(0, chunk.start_position), \
                f"seq {chunk.seq_id} continues at {chunk.start_position} from a state of {self.slots[live]}"
            for rows, slot in marks.pop(chunk.seq_id, []):
                assert 0 < rows <= chunk.num_tokens and (chunk.start_position + rows) % BLOCK_SIZE == 0
                self.slots[slot] = seq.token_ids(0, chunk.start_position + rows)
            self.slots[live] = seq.token_ids(0, chunk.start_position + chunk.num_tokens)
        assert not marks, "a checkpoint for a sequence not in the step"


def run_step(scheduler: Scheduler, checker: StateChecker, seqs: dict[int, Sequence], token: int = 7) -> StepPlan:
    plan = scheduler.schedule()
    checker.apply(plan, seqs)
    scheduler.update(plan, StepResult(plan.step_id, (token,) * plan.num_samples))
    scheduler.check_invariants()
    return plan


def run_to_end(scheduler: Scheduler, checker: StateChecker, seqs: dict[int, Sequence]) -> None:
    for _ in range(200):
        if not scheduler.has_work():
            return
        run_step(scheduler, checker, seqs)
    raise AssertionError("did not finish")


def hybrid_scheduler(num_live: int = 4, num_checkpoints: int = 64, max_tokens_per_step: int = 64,
                     caching: bool = True) -> tuple[Scheduler, StateChecker]:
    slots = StateSlots(num_live, num_checkpoints)
    scheduler = Scheduler(BlockAllocator(128, BLOCK_SIZE), num_live, max_tokens_per_step,
                          enable_prefix_caching=caching, check_writes=True, state_slots=slots)
    return scheduler, StateChecker(slots.num_slots)


def test_live_slots_lowest_first_and_checkpoints_overwrite_the_least_recent() -> None:
    slots = StateSlots(2, 2)
    assert (slots.take_live(), slots.take_live(), slots.take_live()) == (0, 1, None)
    slots.free_live(0)
    assert slots.num_free_live == 1 and slots.held_live == {1}
    with pytest.raises(ValueError, match="not held"):
        slots.free_live(0)
    assert (slots.reserve_checkpoint(b"a"), slots.reserve_checkpoint(b"b")) == (2, 3)
    assert slots.reserve_checkpoint(b"a") is None  # saved already
    assert not slots.has_checkpoint(b"a") and slots.reserve_checkpoint(b"c") is None  # pending: this plan saves them
    slots.end_plan()
    assert slots.restore(b"a") == 2  # now the most recent: "b" is overwritten next
    assert slots.reserve_checkpoint(b"c") == 3 and not slots.has_checkpoint(b"b")
    assert slots.resumable_blocks([b"x", b"a", b"y"], 3) == 2
    assert slots.resumable_blocks([b"a", b"b"], 0) == 0
    slots.reset_checkpoints()
    assert slots.num_saved_checkpoints == 0 and slots.reserve_checkpoint(b"a") == 2


def test_admission_waits_for_a_free_live_slot_and_every_end_gives_it_back() -> None:
    slots = StateSlots(2)
    scheduler = Scheduler(BlockAllocator(64, BLOCK_SIZE), 4, 64, state_slots=slots)
    checker = StateChecker(slots.num_slots)
    seqs = {i: make_seq(i, [10 + i] * 5) for i in range(4)}
    for seq in seqs.values():
        scheduler.add(seq)
    plan = run_step(scheduler, checker, seqs)
    assert [new.state_slot for new in plan.new_seqs] == [0, 1] and len(scheduler.waiting) == 2
    scheduler.finish(seqs[0], FinishReason.ABORT)  # abort gives the slot back: the next one takes it
    plan = run_step(scheduler, checker, seqs)
    assert [new.state_slot for new in plan.new_seqs] == [0]
    scheduler._preempt(seqs[1])  # preemption too: recomputed from a fresh slot later
    assert slots.num_free_live == 1 and seqs[1].state_slot == -1
    run_to_end(scheduler, checker, seqs)
    assert slots.num_free_live == 2 and not slots.held_live


def test_speculation_is_refused_for_hybrids() -> None:
    from coordinator.ngram_proposer import NgramProposer

    with pytest.raises(ValueError, match="hybrid"):
        Scheduler(BlockAllocator(8, BLOCK_SIZE), 2, 64, proposer=NgramProposer(2, 1, 3), state_slots=StateSlots(2))


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("num_blocks", range(1, 9))
def test_repeated_and_shared_prefix_prompts_resume_from_the_longest_saved_boundary(num_blocks: int,
                                                                                   chunked: bool) -> None:
    """Prompts of 1 to 8 blocks (plus 1 to 3 tokens), prefilled whole or in 3-token chunks: a repeat
    hits every full block below its last token, a prompt sharing its first half hits that half's
    blocks, each resuming from the checkpoint there; a preempted repeat hits again."""
    scheduler, checker = hybrid_scheduler(max_tokens_per_step=3 if chunked else 64)
    rng = random.Random(num_blocks)
    prompt = [rng.randrange(10, 90) for _ in range(num_blocks * BLOCK_SIZE + rng.randrange(1, 4))]
    shared_len = (num_blocks // 2 + 1) * BLOCK_SIZE - 1  # ends inside a block: hits the full ones before
    other = prompt[:shared_len] + [rng.randrange(100, 190) for _ in range(5)]
    seqs = {0: make_seq(0, prompt)}
    scheduler.add(seqs[0])
    run_to_end(scheduler, checker, seqs)
    seqs[1], seqs[2] = make_seq(1, prompt), make_seq(2, other)
    scheduler.add(seqs[1])
    scheduler.add(seqs[2])
    run_to_end(scheduler, checker, seqs)
    longest = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # the longest saved boundary below the prompt's end
    assert seqs[1].num_cached_prompt_tokens == longest >= BLOCK_SIZE
    assert seqs[2].num_cached_prompt_tokens == shared_len // BLOCK_SIZE * BLOCK_SIZE
    assert checker.num_restores == 2 if seqs[2].num_cached_prompt_tokens else 1
    # After a preemption the repeat resumes from the checkpoint again, not from zero.
    seqs[3] = make_seq(3, prompt)
    scheduler.add(seqs[3])
    run_step(scheduler, checker, seqs)
    scheduler._preempt(seqs[3])
    run_to_end(scheduler, checker, seqs)
    assert scheduler.kv_cache.state is not None and scheduler.kv_cache.state.num_checkpoint_hits == checker.num_restores
    assert scheduler.prefix_cache_hits >= 3 * longest


def test_without_a_checkpoint_a_hit_is_no_longer_than_the_saved_state() -> None:
    """KV blocks cached but their checkpoints overwritten (one checkpoint slot): the hit ends at the
    one boundary still saved, never at the KV blocks alone."""
    scheduler, checker = hybrid_scheduler(num_checkpoints=1)
    prompt = list(range(20, 33))  # 13 tokens: boundaries 4, 8, 12; only 12's state survives
    seqs = {0: make_seq(0, prompt), 1: make_seq(1, prompt), 2: make_seq(2, prompt[:9] + [5, 5, 5])}
    for seq_id in range(3):
        scheduler.add(seqs[seq_id])
        run_to_end(scheduler, checker, seqs)
    assert seqs[1].num_cached_prompt_tokens == 12 and checker.num_restores == 1  # the repeat: from 12's state
    assert seqs[2].num_cached_prompt_tokens == 0  # blocks 0-1 cached, no state at 8: computed from 0
    assert scheduler.kv_cache.allocator.lookup(seqs[2].block_hashes[:2])  # (the KV blocks were there)


def test_caching_off_saves_and_restores_nothing() -> None:
    scheduler, checker = hybrid_scheduler(caching=False)
    seqs = {i: make_seq(i, list(range(10, 27))) for i in range(2)}
    plans = []
    for seq in seqs.values():
        scheduler.add(seq)
    for _ in range(50):
        if scheduler.has_work():
            plans.append(run_step(scheduler, checker, seqs))
    assert not any(p.state_checkpoints or p.restored_states for p in plans)
    assert all(seq.num_cached_prompt_tokens == 0 for seq in seqs.values())


def test_random_workload_with_evictions_keeps_every_state_exact() -> None:
    rng = random.Random(44)
    scheduler, checker = hybrid_scheduler(num_live=3, num_checkpoints=5, max_tokens_per_step=7)
    bases = [[rng.randrange(10, 90) for _ in range(14)] for _ in range(3)]
    seqs: dict[int, Sequence] = {}
    for step in range(300):
        if step < 200 and rng.random() < 0.3:
            seq_id = len(seqs)
            base = rng.choice(bases)
            seqs[seq_id] = make_seq(seq_id, base[:rng.randrange(2, 15)] + [rng.randrange(10, 90)] * rng.randrange(0, 3),
                                    max_tokens=rng.randrange(1, 5))
            scheduler.add(seqs[seq_id])
        if scheduler.running and rng.random() < 0.05:
            scheduler._preempt(rng.choice(scheduler.running))
        if scheduler.has_work():
            run_step(scheduler, checker, seqs)
    run_to_end(scheduler, checker, seqs)
    assert checker.num_restores >= 5 and not scheduler.state_slots.held_live


def test_the_pool_splits_into_max_num_seqs_live_slots_and_checkpoints() -> None:
    from coordinator.state_slots import hybrid_state_slots
    from tpserve.model_config import ModelConfig

    base = {"architectures": ["Lfm2ForCausalLM"], "vocab_size": 190, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 3, "num_attention_heads": 4, "max_position_embeddings": 256}
    hybrid = ModelConfig.from_dict({**base, "layer_types": ["conv", "full_attention", "conv"]})
    slots = hybrid_state_slots(hybrid, 4, 30)
    assert slots is not None and (slots.num_live, slots.num_checkpoints, slots.num_slots) == (4, 26, 30)
    with pytest.raises(ValueError, match="3 state slots, fewer than --max-num-seqs 4"):
        hybrid_state_slots(hybrid, 4, 3)
    dense = ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"]})
    assert hybrid_state_slots(dense, 4, 0) is None and dense.num_attention_layers == 3
    with pytest.raises(ValueError, match="layer_types"):  # a state kind only where the family has one
        ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"], "layer_types": ["conv"] * 3})
