"""Logprobs on the sampling rank equal ``log_softmax`` of transformers' logits (tp 1, stories260k).

The reported distribution is the raw one: a request sampled at temperature 0.7 with a
repetition penalty reports the same values as the model's plain logits. Only the rows
that ask get logprobs. (tp 2 through the server: tests/e2e/test_sampling_controls.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import load_hf_model
from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.logprobs import sample_logprobs
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

PROMPT = [1, 403, 407, 261, 378]
ASKING = SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.4, logprobs=True, top_logprobs=5)
SILENT = SamplingParams(temperature=0.0)


def test_only_asking_rows_get_logprobs_and_top_k_is_sorted() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([4, 7, 9])
    out = sample_logprobs(logits, tokens, [SILENT, SamplingParams(logprobs=True, top_logprobs=3),
                                           SamplingParams(logprobs=True)])
    assert [lp.sample_index for lp in out] == [1, 2]
    want = torch.log_softmax(logits, dim=-1)
    assert out[0].logprob == pytest.approx(float(want[1, 7]), abs=1e-6)
    assert list(out[0].top_token_ids) == want[1].topk(3).indices.tolist()
    assert out[0].top_logprobs == pytest.approx(want[1].topk(3).values.tolist(), abs=1e-6)
    assert out[1].top_token_ids == () and out[1].logprob == pytest.approx(float(want[2, 9]), abs=1e-6)
    assert sample_logprobs(logits, tokens, [SILENT] * 3) == ()


def test_reported_logprobs_are_log_softmax_of_transformers_logits(stories_dir: Path) -> None:
    runner = ModelRunner(stories_dir, ParallelContext.single(), torch.float32, block_size=4)
    runner.init_kv_cache(num_blocks=16)
    plan = StepPlan(0, (NewSequence(0, ASKING, len(PROMPT)), NewSequence(1, SILENT, len(PROMPT))),
                    (ScheduledChunk(0, tuple(PROMPT), 0, (0, 1, 2)), ScheduledChunk(1, tuple(PROMPT), 0, (3, 4, 5))))
    tokens, reported = [], []
    for step in range(6):
        result = runner.execute(plan)
        (lp,) = result.logprobs
        assert lp.sample_index == 0
        tokens.append(result.sampled_token_ids[0])
        reported.append(lp)
        pos = len(PROMPT) + step
        plan = StepPlan(step + 1, (), (ScheduledChunk(0, (tokens[-1],), pos),
                                       ScheduledChunk(1, (result.sampled_token_ids[1],), pos)))
    model = load_hf_model(stories_dir)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0].float()  # (L, V)
    want = torch.log_softmax(logits[len(PROMPT) - 1:len(PROMPT) - 1 + len(tokens)], dim=-1)  # (6, V)
    for row, (token, lp) in enumerate(zip(tokens, reported, strict=True)):
        assert lp.logprob == pytest.approx(float(want[row, token]), abs=1e-4)
        top = want[row].topk(5)
        assert list(lp.top_token_ids) == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)


def test_prompt_logprobs_over_chunks_are_log_softmax_of_transformers_logits(stories_dir: Path) -> None:
    runner = ModelRunner(stories_dir, ParallelContext.single(), torch.float32, block_size=4)
    runner.init_kv_cache(num_blocks=16)
    prompt = PROMPT + [432, 383, 286, 261, 376]  # 10 tokens, prefilled in chunks of 4, 4 and 2
    asking = SamplingParams(temperature=0.0, prompt_logprobs=3)
    other = NewSequence(1, SILENT, len(PROMPT))
    plans = [
        StepPlan(0, (NewSequence(0, asking, len(prompt), prompt_token_ids=tuple(prompt)), other),
                 (ScheduledChunk(1, tuple(PROMPT), 0, (8, 9)), ScheduledChunk(0, tuple(prompt[:4]), 0, (0,), False))),
        StepPlan(1, (), (ScheduledChunk(1, (7,), 5), ScheduledChunk(0, tuple(prompt[4:8]), 4, (1,), False))),
        StepPlan(2, (), (ScheduledChunk(1, (7,), 6), ScheduledChunk(0, tuple(prompt[8:]), 8, (2,)))),
    ]
    scored = {}
    for plan in plans:
        for p in runner.execute(plan).prompt_logprobs:
            assert p.seq_id == 0
            for i, lp in enumerate(p.logprobs):
                scored[p.first_position + i] = (lp, p.top_token_ids[i], p.top_logprobs[i])
    assert sorted(scored) == list(range(1, 10))  # every prompt token but the first, across chunk boundaries
    model = load_hf_model(stories_dir)
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)  # (10, V)
    for position, (lp, top_ids, top_lps) in scored.items():
        assert lp == pytest.approx(float(want[position - 1, prompt[position]]), abs=1e-4)
        assert list(top_ids) == want[position - 1].topk(3).indices.tolist()
        assert top_lps == pytest.approx(want[position - 1].topk(3).values.tolist(), abs=1e-4)
