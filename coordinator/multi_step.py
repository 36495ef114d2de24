"""Multi-step scheduling (``--num-scheduler-steps``; vLLM 0.6's name): one plan, k decode steps.

At one request a CPU rank's decode step is a few milliseconds, and the coordinator's part of
each token (receiving the result, stop checks, detokenizing, the gRPC write, the next plan and
its round trip) is most of a millisecond on the same cores (benchmarks/README.md,
"Where those 1.7 ms go"). When every running sequence is decoding, a plan may ask the ranks to
run its decodes k times in a row, each feeding the token they sampled the time before
(worker/multi_step.py): that work then comes once per k tokens.

A plan is multi-step only when nothing else could use the steps: no request could be admitted
(none waits, or every sequence slot is taken and the first waiting request outranks no running
one; an arrival, or a request whose slot a stop frees inside a plan, waits at most k - 1 steps
for its prefill, vLLM's trade as well), every running
sequence decodes one token with no sample pending, none follows a grammar (its matcher would
run past a stop), and every sequence has room for k more tokens under ``max_tokens`` and
``max_model_len`` (k is cut to the smallest room) and the pool has their blocks (else one
step, as without it, which may preempt). A sequence that stops at step j < k (an end-of-sequence
token, a stop token, a stop string found while streaming) keeps only its tokens up to the
stop; the ranks' later steps for it are wasted work, and their K/V lands in blocks the
coordinator frees only after the whole plan's result is in, so no other sequence holds them yet.
No torch.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from coordinator.block_allocator import num_blocks_for
from coordinator.kv_cache_manager import KVCacheManager
from coordinator.priority import PriorityPolicy
from coordinator.sequence import Sequence
from coordinator.spec_scheduling import TokenOutput
from tpserve.step import SampleLogprobs, ScheduledChunk


def check_num_steps(num_scheduler_steps: int, one_step_only: bool) -> int:
    """``num_scheduler_steps``, checked: at least 1, and 1 where ``one_step_only`` (async scheduling, a proposer).

    Raises:
        ValueError: it is not.
    """
    if num_scheduler_steps < 1 or num_scheduler_steps > 1 and one_step_only:
        raise ValueError(f"num_scheduler_steps={num_scheduler_steps}: needs at least 1, and 1 with async "
                         "scheduling or speculative decoding")
    return num_scheduler_steps


def admission_blocked(waiting: Collection[Sequence], running: Collection[Sequence], max_num_seqs: int,
                      policy: PriorityPolicy) -> bool:
    """Whether the next plan could admit no waiting sequence: none waits, or all ``max_num_seqs`` slots
    are taken and the first waiting one outranks no running one (no priority preemption would free one)."""
    if not waiting:
        return True
    head = next(iter(waiting))
    return len(running) >= max_num_seqs and not any(policy.outranks(head, seq) for seq in running)


def num_steps_for(running: Iterable[Sequence], max_steps: int, num_free_blocks: int, block_size: int) -> int:
    """How many decode steps the next plan may run for ``running`` at once: 1 unless every one
    qualifies (module docstring), else ``max_steps`` cut to the smallest room left by
    ``max_tokens`` and ``max_model_len``, or 1 when the pool lacks the blocks for that many."""
    steps, needed = max_steps, 0
    seqs = list(running)
    for seq in seqs:
        if seq.num_tokens - seq.num_computed_tokens != 1 or seq.num_pending_tokens or seq.sampling.grammar:
            return 1
        steps = min(steps, seq.stop.max_tokens - seq.num_output_tokens, seq.max_model_len - seq.num_tokens)
        if steps <= 1:
            return 1
    for seq in seqs:
        needed += max(num_blocks_for(seq.num_computed_tokens + steps, block_size) - len(seq.block_ids), 0)
    return steps if needed <= num_free_blocks else 1


def multi_step_chunks(running: list[Sequence], max_seqs: int, max_steps: int, kv_cache: KVCacheManager,
                      scheduled: list[ScheduledChunk]) -> int:
    """The next plan's steps, for a scheduler with nothing waiting: when every one of ``running``
    qualifies (:func:`num_steps_for`) and they are at most ``max_seqs`` (the step's sequence cap and
    token budget), appends each one's decode (its last token at its first uncomputed position) with
    the blocks of k steps to ``scheduled`` and returns k; else returns 1 and appends nothing."""
    if not running or len(running) > max_seqs:
        return 1
    num_steps = num_steps_for(running, max_steps, kv_cache.allocator.num_free_blocks, kv_cache.block_size)
    if num_steps == 1:
        return 1
    for seq in running:
        new_block_ids = kv_cache.grow(seq, num_steps)
        assert new_block_ids is not None  # counted by num_steps_for
        start = seq.num_computed_tokens
        scheduled.append(ScheduledChunk(seq.seq_id, seq.token_ids(start, start + 1), start, tuple(new_block_ids)))
    return num_steps


def apply_steps(seq: Sequence, chunk: ScheduledChunk, token_ids: tuple[int, ...], kv_cache: KVCacheManager,
                logprobs: dict[int, SampleLogprobs], first_sample: int) -> list[TokenOutput]:
    """Appends a multi-step chunk's tokens (one per step) up to a stop; the last output's finish
    reason says whether the sequence stopped (the caller then finishes it). ``logprobs`` by
    sample index; the chunk's step j is sample ``first_sample + j``."""
    outputs: list[TokenOutput] = []
    for step, token_id in enumerate(token_ids):
        reason = seq.append_token(token_id)
        outputs.append(TokenOutput(seq, token_id, reason, logprobs.get(first_sample + step)))
        if reason is not None:
            break  # nothing past a stop
    # Step j wrote the K/V of the token it fed, at start + j: known for every step applied.
    num_computed = chunk.start_position + len(outputs)
    kv_cache.cache_full_blocks(seq, num_computed)
    seq.num_computed_tokens = num_computed
    return outputs
