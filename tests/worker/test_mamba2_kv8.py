"""``--kv-cache-dtype int8 / fp8`` on the Mamba-2 hybrids: their attention layers (NoPE) write and read an
8-bit cache with the calibrated scales; the state layers keep their float32 states.

Granite 4 hybrid and Nemotron-H (tests/worker/hybrid_specs.py) through a tp 1 runner: four prompts longer
than a Mamba chunk in one batch (each with its own state slot), 16 greedy tokens, against the same runner
with a float32 cache: the 8-bit cache holds 8-bit codes, the states stay float32, the logits of every step
(teacher-forced on the float cache's tokens) stay within the quantization's error of the float cache's
(int8: mean 1 % and max 15 % of the logits' spread; fp8: mean 5 %), and 90 % of the greedy tokens agree.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.hybrid_specs import GRANITE_HYBRID_MOE, NEMOTRON_H, prompts, save_hybrid_model
from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

BLOCK_SIZE = 16
NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0)


def _run(runner: ModelRunner, batch: tuple[tuple[int, ...], ...], forced: list[list[int]] | None) -> tuple[
        list[list[int]], list[torch.Tensor]]:
    """Greedy tokens (or ``forced`` ones fed back) of every prompt, and each step's logits ``(B, vocab)``."""
    new = tuple(NewSequence(i, GREEDY, state_slot=i) for i in range(len(batch)))
    chunks = tuple(ScheduledChunk(i, p, 0, tuple(range(4 * i, 4 * i + 4))) for i, p in enumerate(batch))
    out = [[t] for t in runner.execute(StepPlan(0, new, chunks)).sampled_token_ids]
    logits = [runner.last_logits.clone()]
    for k in range(1, NUM_TOKENS):
        fed = [(forced or out)[i][k - 1] for i in range(len(batch))]
        step = tuple(ScheduledChunk(i, (fed[i],), len(p) + k - 1) for i, p in enumerate(batch))
        for i, t in enumerate(runner.execute(StepPlan(k, (), step)).sampled_token_ids):
            out[i].append(t)
        logits.append(runner.last_logits.clone())
    return out, logits


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("spec", [GRANITE_HYBRID_MOE, NEMOTRON_H], ids=lambda s: s.name)
def test_eight_bit_kv_cache_on_a_mamba2_hybrid(spec, kv_cache_dtype, tmp_path) -> None:
    model_dir = save_hybrid_model(spec, tmp_path / spec.name)
    batch = prompts(4, seed=11)
    runners = {}
    for dtype in ("auto", kv_cache_dtype):
        runners[dtype] = ModelRunner(model_dir, ParallelContext.single(), torch.float32, BLOCK_SIZE,
                                     kv_cache_dtype=dtype)
        runners[dtype].init_kv_cache(16, num_state_slots=8)
    eight_bit = runners[kv_cache_dtype]
    kinds = eight_bit.config.layer_types
    attention = [c for c, kind in zip(eight_bit.kv_caches, kinds, strict=True) if kind == "full_attention"]
    states = [c for c, kind in zip(eight_bit.kv_caches, kinds, strict=True) if kind == "linear_attention"]
    assert attention and all(k.element_size() == v.element_size() == 1 for k, v in attention)
    assert states and all(t.dtype == torch.float32 for state in states for t in state)
    want, want_logits = _run(runners["auto"], batch, None)
    got, got_logits = _run(eight_bit, batch, want)  # teacher-forced on the float cache's tokens
    got_all, want_all = torch.stack(got_logits), torch.stack(want_logits)  # (steps, B, vocab)
    spread = float(want_all.std())
    error = (got_all - want_all).abs()
    if kv_cache_dtype == "int8":  # 256 levels per channel: every logit close
        assert float(error.mean()) < 0.01 * spread and float(error.max()) < 0.15 * spread
    else:  # e4m3: 3 mantissa bits, about 6 % per element, so the mean only
        assert float(error.mean()) < 0.05 * spread
    assert float(error.max()) > 0  # really another cache
    assert sum(g == w for gs, ws in zip(got, want) for g, w in zip(gs, ws)) >= 0.9 * 4 * NUM_TOKENS
