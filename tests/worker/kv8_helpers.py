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
