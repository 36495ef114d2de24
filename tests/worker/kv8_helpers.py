"""Greedy runs of a one-process runner with an 8-bit KV cache (tests/worker/test_kv_cache_dtype.py,
tests/e2e/test_kv_cache_dtype_serving.py, benchmarks/kv_cache_dtype.py), and a float32 cache whose rows
are rounded as another storage would round them: a 16-bit cache under the same float32 activations (the
issue's reference), or a candidate 8-bit scheme (benchmarks/kv_cache_fp8_variants.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.attention import PagedAttention
from worker.layers.decode_block import disable_decode_blocks
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

GREEDY = SamplingParams(temperature=0.0)

#: ``(k, v, layer, positions) -> (k, v)``: rows ``(T, KVH, d)`` float32 of layer ``layer`` (0-based) at
#: ``positions (T,) int64`` (None: a whole block, :func:`rounded_cache_runner`'s ``when_full``), as a cache
#: stores them (float32 values; ``k``, ``v`` themselves left unchanged).
RoundRows = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def eight_bit_runner(model_dir: Path, kv_cache_dtype: str, num_blocks: int = 48, block_size: int = 16) -> ModelRunner:
    """A tp 1 float32 runner of ``model_dir`` with ``--kv-cache-dtype kv_cache_dtype``, its cache allocated (and calibrated)."""
    runner = ModelRunner(model_dir, ParallelContext.single(), torch.float32, block_size=block_size,
                         kv_cache_dtype=kv_cache_dtype)
    runner.init_kv_cache(num_blocks)
    return runner


def sixteen_bit(dtype: torch.dtype) -> RoundRows:
    """Rows rounded to ``dtype`` (bfloat16 or float16, to nearest even) and read back exactly: a 16-bit cache
    under float32 activations and float32 attention math."""
    return lambda k, v, layer, positions: (k.to(dtype).float(), v.to(dtype).float())


def rounded_cache_runner(model_dir: Path, round_rows: RoundRows, *, when_full: bool = False, num_blocks: int = 48,
                         block_size: int = 16) -> ModelRunner:
    """A tp 1 float32 runner (``--kv-cache-dtype auto``) whose cache holds each row as ``round_rows`` rounds it.

    Every layer's :class:`PagedAttention` gets the step's rows after the fused write has stored them: they
    are rounded, stored again, and passed on rounded, so that every read (the compiled paged kernel, SDPA
    over a gathered history, a first chunk over its own rows) sees what such a cache would hold. The
    compiled one-call decode stack, which would write without the hook, is turned off (its logits are the
    module path's bit for bit: test_kv_cache_dtype.py). ``when_full``: rows are stored as they come, and a
    block's rows are rounded in place once its last slot is written (a cache that keeps the block being
    written in full precision).
    """
    runner = eight_bit_runner(model_dir, "auto", num_blocks, block_size)
    disable_decode_blocks(runner.model)
    layers = [m for m in runner.model.modules() if isinstance(m, PagedAttention)]
    for index, attn in enumerate(layers):
        attn.forward = _rounding_forward(attn.forward, round_rows, index, when_full)  # type: ignore[method-assign]
    return runner


def _rounding_forward(forward, round_rows: RoundRows, layer: int, when_full: bool):
    """``PagedAttention.forward`` with this step's rows rounded first (:func:`rounded_cache_runner`)."""
    def rounded(q, k, v, k_cache, v_cache, meta):
        num_kv_heads, d, block_size = k.shape[1], k.shape[2], k_cache.shape[1]
        slots, positions = meta.slot_mapping, meta.positions[: k.shape[0]]
        k_rows, v_rows = k_cache.view(-1, num_kv_heads, d), v_cache.view(-1, num_kv_heads, d)
        if not when_full:
            rk, rv = round_rows(k.float(), v.float(), layer, positions)
            k.copy_(rk)  # in place: k, v may be views of the step's fused projection
            v.copy_(rv)
            k_rows.index_copy_(0, slots, k.contiguous())
            v_rows.index_copy_(0, slots, v.contiguous())
            return forward(q, k, v, k_cache, v_cache, meta)
        filled = slots[slots % block_size == block_size - 1] // block_size  # blocks whose last slot is this step's
        for block in filled.tolist():
            k_cache[block], v_cache[block] = round_rows(k_cache[block], v_cache[block], layer, None)
        done = torch.isin(slots // block_size, filled)
        if bool(done.any()):  # this step's rows in those blocks are read rounded too (a first chunk's own rows)
            k[done], v[done] = k_rows[slots[done]], v_rows[slots[done]]
        return forward(q, k, v, k_cache, v_cache, meta)
    return rounded


def teacher_forced(runner: ModelRunner, prompts: list[list[int]], forced: list[list[int]] | None,
                   num_tokens: int = 0, logits: list[torch.Tensor] | None = None) -> list[list[int]]:
    """Per prompt, the greedy token after the prompt and after each prefix of ``forced`` (all prompts in one
    batch); ``forced`` None: free-running greedy, ``num_tokens`` each. ``logits``: each step's
    ``(num_prompts, vocab)`` logits are appended to it."""
    forced = forced or [[0] * num_tokens for _ in prompts]
    bs, blocks, new, chunks = runner.block_size, 0, [], []
    for i, (prompt, tokens) in enumerate(zip(prompts, forced)):
        need = -(-(len(prompt) + len(tokens)) // bs)
        new.append(NewSequence(i, GREEDY))
        chunks.append(ScheduledChunk(i, tuple(prompt), 0, tuple(range(blocks, blocks + need))))
        blocks += need
    out = [[t] for t in runner.execute(StepPlan(0, tuple(new), tuple(chunks))).sampled_token_ids]
    if logits is not None:
        logits.append(runner.last_logits.clone())
    for k in range(1, len(forced[0])):
        step = [ScheduledChunk(i, (forced[i][k - 1] if num_tokens == 0 else out[i][-1],), len(prompts[i]) + k - 1)
                for i in range(len(prompts))]
        for i, t in enumerate(runner.execute(StepPlan(k, (), tuple(step))).sampled_token_ids):
            out[i].append(t)
        if logits is not None:
            logits.append(runner.last_logits.clone())
    runner.execute(StepPlan(len(forced[0]), finished_seq_ids=tuple(range(len(prompts)))))
    return out


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """The share of ``want``'s tokens that ``got`` has at the same position."""
    return sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / sum(map(len, want))


def prefix_agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """The share of ``want``'s tokens that ``got`` reproduces position by position up to each line's first
    difference: a divergence costs the rest of its line (a later chance match does not count)."""
    kept = 0
    for g, w in zip(got, want, strict=True):
        kept += next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
    return kept / sum(map(len, want))


def prompt_logits(runner: ModelRunner, seq: int, chunks: list[tuple[tuple[int, ...], int, tuple[int, ...]]],
                  step: int) -> torch.Tensor:
    """Run ``seq``'s prompt as ``chunks`` of (tokens, start, new blocks); the logits after its last token."""
    for i, (tokens, start, blocks) in enumerate(chunks):
        new = (NewSequence(seq, GREEDY),) if i == 0 else ()
        runner.execute(StepPlan(step + i, new, (ScheduledChunk(seq, tokens, start, blocks,
                                                               sample=i == len(chunks) - 1),)))
    return runner.last_logits[0].clone()


def check_reads_match_a_miss(runner: ModelRunner) -> None:
    """With one 8-bit cache (a runner of block size 16, 14 blocks at least), a prefix-cache hit (blocks another
    sequence wrote), a chunked prompt and a preempted-and-recomputed sequence give a miss's logits (to 1e-4, the
    same greedy token), and 6 decode steps read from the cache give what one prefill of prompt and output gives:
    every read sees the values the cache holds, and a first chunk its own rows rounded as the cache rounds them."""
    prompt = tuple(range(3, 43))  # 40 tokens: blocks of 16, 16 and 8
    miss = prompt_logits(runner, 0, [(prompt, 0, (0, 1, 2))], 0)
    hit = prompt_logits(runner, 1, [(prompt[32:], 32, (0, 1, 3))], 1)  # blocks 0, 1 shared with sequence 0
    chunked = prompt_logits(runner, 2, [(prompt[:20], 0, (4, 5)), (prompt[20:], 20, (6,))], 2)
    runner.execute(StepPlan(4, finished_seq_ids=(0, 1, 2)))
    recomputed = prompt_logits(runner, 0, [(prompt, 0, (7, 8, 9))], 5)  # preempted: its prompt again
    for other in (hit, chunked, recomputed):
        torch.testing.assert_close(other, miss, atol=1e-4, rtol=0)
        assert other.argmax() == miss.argmax()
    tokens = [int(miss.argmax())]
    for k in range(6):
        runner.execute(StepPlan(6 + k, (), (ScheduledChunk(0, (tokens[-1],), 40 + k, (10,) if k == 0 else ()),)))
        tokens.append(int(runner.last_logits[0].argmax()))
    decoded = runner.last_logits[0].clone()
    runner.execute(StepPlan(12, finished_seq_ids=(0,)))
    resumed = prompt_logits(runner, 0, [(prompt + tuple(tokens[:-1]), 0, (11, 12, 13))], 13)
    torch.testing.assert_close(resumed, decoded, atol=1e-4, rtol=0)
    assert resumed.argmax() == decoded.argmax()


def greedy_through_scheduler(runner: ModelRunner, prompts: list[list[int]], num_tokens: int, num_blocks: int,
                             vocab_size: int, proposer: object = None) -> tuple[list[list[int]], object]:
    """``prompts`` added together to the real scheduler (prefix caching on, writes checked; ``proposer``: its
    speculation) and stepped through ``runner`` until done: each prompt's ``num_tokens`` greedy tokens, and
    the scheduler (its ``spec`` counts). Checks that every block and sequence is released at the end."""
    from coordinator.block_allocator import BlockAllocator
    from coordinator.scheduler import Scheduler
    from coordinator.sequence import Sequence, StopParams

    scheduler = Scheduler(BlockAllocator(num_blocks, runner.block_size), max_num_seqs=16, max_num_batched_tokens=256,
                          enable_prefix_caching=True, check_writes=True, proposer=proposer)
    seqs = [Sequence(i, list(p), GREEDY, StopParams(num_tokens, frozenset()), vocab_size) for i, p in enumerate(prompts)]
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_work():
        plan = scheduler.schedule()
        scheduler.update(plan, runner.execute(plan))
        scheduler.check_invariants()
    runner.execute(scheduler.schedule())  # the last drops
    assert runner.num_sequences == 0 and scheduler.allocator.num_free_blocks == num_blocks
    return [seq.output_token_ids for seq in seqs], scheduler
