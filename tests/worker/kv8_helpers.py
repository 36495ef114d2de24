"""Greedy runs of a one-process runner with an 8-bit KV cache (tests/worker/test_kv_cache_dtype.py and
tests/e2e/test_kv_cache_dtype_serving.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

GREEDY = SamplingParams(temperature=0.0)


def eight_bit_runner(model_dir: Path, kv_cache_dtype: str, num_blocks: int = 48, block_size: int = 16) -> ModelRunner:
    """A tp 1 float32 runner of ``model_dir`` with ``--kv-cache-dtype kv_cache_dtype``, its cache allocated (and calibrated)."""
    runner = ModelRunner(model_dir, ParallelContext.single(), torch.float32, block_size=block_size,
                         kv_cache_dtype=kv_cache_dtype)
    runner.init_kv_cache(num_blocks)
    return runner


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
