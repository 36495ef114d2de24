"""Step plans and their expected results (parent-process side of the TP tests).

:func:`build_plans` is a miniature, deterministic stand-in for the coordinator's
scheduler: sequences arrive at given steps, prompts are prefilled in chunks,
running sequences decode, a sequence may be preempted (dropped and re-sent whole
as a ``NewSequence`` in the same plan), finished sequences are named in the next
plan and their blocks reused, and block ids come from a shuffled free list.
Decodes are teacher-forced with the reference completion, so the plans are
plain data every rank can receive; a worker that samples the reference token at
every step therefore reproduces the reference generation.

:func:`hf_reference` makes that reference with ``transformers``: greedy rows with
``generate(do_sample=False)``, seeded sampled rows with our sampler applied to
``transformers``' logits, and the logits of every sampled position.

Hybrid models (``state_slots=True``): each sequence also holds a live state slot from
its arrival (or re-arrival after a preemption) to its end, each prefill chunk saves the
state at every prompt block boundary it crosses into a fresh checkpoint slot (from
``num_live`` up), and a prefix-cache hit restores the source's checkpoint at the shared
boundary (``StepPlan.restored_states``) before prefilling the rest.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.sampler import sample

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class SeqSpec:
    """A request of the scenario.

    Attributes:
        seq_id: its id.
        prompt: prompt token ids.
        num_new_tokens: tokens to generate.
        sampling: sampling parameters.
        arrive_step: the step whose plan first names it.
        prefill_chunk: most prompt tokens per step (None: the whole prompt).
        preempt_after: preempt it once, after this many generated tokens.
        prefix_from: a prefix-cache hit: on arrival it shares the blocks of this
            (running) sequence that hold their common prompt prefix, whole blocks
            only and never its last prompt token, and prefills only the rest.
    """

    seq_id: int
    prompt: tuple[int, ...]
    num_new_tokens: int
    sampling: SamplingParams = GREEDY
    arrive_step: int = 0
    prefill_chunk: int | None = None
    preempt_after: int | None = None
    prefix_from: int | None = None


@dataclass
class _State:
    spec: SeqSpec
    num_computed: int = 0
    num_sampled: int = 0
    block_table: list[int] | None = None
    preempted: bool = False


def _new_sequence(spec: SeqSpec, state_slot: int = 0) -> NewSequence:
    prompt = spec.prompt if spec.sampling.prompt_logprobs is not None else ()
    return NewSequence(spec.seq_id, spec.sampling, len(spec.prompt), prompt_token_ids=prompt, state_slot=state_slot)


class _StateSlots:
    """A hybrid scenario's state slots: live ones from a free list, checkpoints by (seq_id, boundary)."""

    def __init__(self, num_live: int, num_slots: int) -> None:
        self.free = list(range(num_live - 1, -1, -1))
        self.live: dict[int, int] = {}
        self.checkpoints: dict[tuple[int, int], int] = {}
        self.next_checkpoint, self.num_slots = num_live, num_slots

    def take(self, seq_id: int) -> int:
        self.live[seq_id] = self.free.pop()
        return self.live[seq_id]

    def give_back(self, seq_id: int) -> None:
        self.free.append(self.live.pop(seq_id))

    def save(self, seq_id: int, start: int, end: int, prompt_len: int, block_size: int) -> list[tuple[int, int, int]]:
        """``(seq_id, rows, slot)`` for each prompt block boundary in ``(start, end]``."""
        marks = []
        for boundary in range((start // block_size + 1) * block_size, min(end, prompt_len) + 1, block_size):
            assert self.next_checkpoint < self.num_slots, "the scenario needs more state slots"
            self.checkpoints[(seq_id, boundary)] = self.next_checkpoint
            marks.append((seq_id, boundary - start, self.next_checkpoint))
            self.next_checkpoint += 1
        return marks


def build_plans(
    specs: list[SeqSpec], completions: dict[int, list[int]], block_size: int, num_blocks: int, seed: int = 0,
    state_slots: bool = False, num_live_slots: int = 32, num_state_slots: int = 256,
) -> tuple[list[StepPlan], list[list[tuple[int, int]]]]:
    """Plans for ``specs`` and, per step, ``(seq_id, completion index)`` of each sample in plan order.

    ``state_slots``: a hybrid model's slots and checkpoints (module docstring), within a pool of
    ``num_state_slots`` (the runner's, worker/state_cache.py) whose first ``num_live_slots`` are live.
    """
    slots = _StateSlots(num_live_slots, num_state_slots) if state_slots else None
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    states: dict[int, _State] = {}
    plans, expected = [], []
    finished_next: list[int] = []
    step = 0
    def release(table: list[int], owner: int) -> None:  # blocks another sequence shares stay taken
        shared = {b for seq_id, st in states.items() if seq_id != owner for b in st.block_table}
        free.extend(b for b in table if b not in shared)

    while step == 0 or states or finished_next or any(s.arrive_step >= step for s in specs):
        finished, new_seqs, scheduled, samples = list(finished_next), [], [], []
        restored, checkpoints = [], []
        for seq_id in finished_next:
            release(states[seq_id].block_table, seq_id)
            del states[seq_id]
            if slots is not None:
                slots.give_back(seq_id)
        finished_next = []
        cached: dict[int, list[int]] = {}  # seq_id -> the blocks of a prefix-cache hit
        for spec in specs:
            if spec.arrive_step == step:
                states[spec.seq_id] = _State(spec, block_table=[])
                new_seqs.append(_new_sequence(spec, slots.take(spec.seq_id) if slots is not None else 0))
                source = states.get(spec.prefix_from) if spec.prefix_from is not None else None
                if source is not None:
                    common = 0
                    while (common < min(len(spec.prompt) - 1, source.num_computed)
                           and spec.prompt[common] == source.spec.prompt[common]):
                        common += 1
                    shared = source.block_table[: common // block_size]
                    if slots is not None and shared:  # resume from the source's state at the shared boundary
                        restored.append((spec.seq_id, slots.checkpoints[(source.spec.seq_id,
                                                                          len(shared) * block_size)]))
                    states[spec.seq_id].block_table = list(shared)
                    states[spec.seq_id].num_computed = len(shared) * block_size
                    cached[spec.seq_id] = list(shared)
        for state in list(states.values()):
            spec = state.spec
            if state.num_sampled == spec.num_new_tokens:
                continue  # done, named in the next plan
            if spec.preempt_after == state.num_sampled and not state.preempted and state.num_computed:
                release(state.block_table, spec.seq_id)  # preempted: dropped, then re-sent whole
                state.block_table, state.num_computed, state.preempted = [], 0, True
                finished.append(spec.seq_id)
                if slots is not None:
                    slots.give_back(spec.seq_id)
                new_seqs.append(_new_sequence(spec, slots.take(spec.seq_id) if slots is not None else 0))
            known = list(spec.prompt) + completions[spec.seq_id][: state.num_sampled]
            limit = spec.prefill_chunk or len(known)
            tokens = known[state.num_computed : state.num_computed + limit]
            end = state.num_computed + len(tokens)
            num_new_blocks = -(-end // block_size) - len(state.block_table)
            new_blocks = [free.pop() for _ in range(num_new_blocks)]
            state.block_table.extend(new_blocks)
            new_blocks = cached.pop(spec.seq_id, []) + new_blocks  # a hit's shared blocks come first
            chunk_samples = end == len(known)
            if slots is not None:
                checkpoints += slots.save(spec.seq_id, state.num_computed, end, len(spec.prompt), block_size)
            scheduled.append(ScheduledChunk(spec.seq_id, tuple(tokens), state.num_computed, tuple(new_blocks),
                                            sample=chunk_samples))
            state.num_computed = end
            if chunk_samples:
                samples.append((spec.seq_id, state.num_sampled))
                state.num_sampled += 1
                if state.num_sampled == spec.num_new_tokens:
                    finished_next.append(spec.seq_id)  # blocks freed when the next plan names it
        plans.append(StepPlan(step, tuple(new_seqs), tuple(scheduled), tuple(finished),
                              restored_states=tuple(restored), state_checkpoints=tuple(checkpoints)))
        expected.append(samples)
        step += 1
    return plans, expected


@torch.no_grad()
def hf_reference(model: torch.nn.Module, specs: list[SeqSpec]) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
    """Reference completions and the logits ``(num_new_tokens, vocab)`` that produced them, per seq_id."""
    model.generation_config.eos_token_id = None  # generate exactly num_new_tokens
    completions, logits = {}, {}
    for spec in specs:
        prompt = torch.tensor([spec.prompt])  # (1, P)
        n = spec.num_new_tokens
        if spec.sampling.greedy:
            out = model.generate(prompt, do_sample=False, max_new_tokens=n, pad_token_id=0)  # (1, P + n)
            completion = out[0, len(spec.prompt):].tolist()
        else:
            completion = []
            for _ in range(n):
                ids = torch.tensor([list(spec.prompt) + completion])  # (1, P + i)
                last = model(ids).logits[:, -1].float()  # (1, V)
                position = ids.shape[1]  # the new token's absolute position
                completion.append(int(sample(last, [spec.sampling], [position])[0]))
        full = torch.tensor([list(spec.prompt) + completion[:-1]])  # (1, P + n - 1)
        all_logits = model(full).logits[0].float()  # (P + n - 1, V)
        completions[spec.seq_id] = completion
        logits[spec.seq_id] = all_logits[len(spec.prompt) - 1 :]  # (n, V)
    return completions, logits


def standard_specs(vocab_size: int, seed: int) -> list[SeqSpec]:
    """The scenario every tiny checkpoint runs (see the module docstring of test_tp_runner)."""
    rng = random.Random(seed)

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, vocab_size) for _ in range(n))

    sampled = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    return [
        SeqSpec(0, prompt(8), 6),
        SeqSpec(1, prompt(3), 4),
        SeqSpec(2, prompt(12), 5, prefill_chunk=7),  # prompt split over two prefill chunks
        SeqSpec(3, prompt(1), 4, SamplingParams(temperature=1.0, seed=7), arrive_step=1),
        SeqSpec(4, prompt(6), 5, sampled, arrive_step=2, preempt_after=2),  # joins running decodes
        SeqSpec(5, prompt(9), 3, arrive_step=5),  # reuses finished sequences' blocks
    ]
