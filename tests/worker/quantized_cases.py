"""A quantized checkpoint's standard scenario checked against ``transformers`` on its dequantized float model.

Shared by the weight formats' tests (tests/worker/test_int8.py, test_int4.py, test_w8a16.py,
test_lowbit_checkpoints.py): the scenario of tests/worker/scenarios.py on the served checkpoint, its
reference (greedy tokens and logits) from ``transformers`` on the format's reference dequantization, every
case of a module run in one process group per tensor-parallel degree, and the check.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.tiny_models import load_hf_model
from tests.worker.scenarios import build_plans, hf_reference, standard_specs
from tests.worker.tp_harness import Job, StepRecord, run_jobs


@dataclass(frozen=True)
class QuantizedCase:
    """One checkpoint's job and what ``transformers`` said on its dequantized weights."""

    job: Job
    expected: list[list[tuple[int, int]]]  # per step: (seq_id, completion index) per sample
    completions: dict[int, list[int]]  # seq_id -> greedy token ids
    logits: dict[int, torch.Tensor]  # seq_id -> (tokens, vocab) float32


def quantized_case(name: str, checkpoint: Path, reference_dir: Path, seed: int, *, block_size: int,
                   num_blocks: int, quantization: str | None = None) -> QuantizedCase:
    """The standard scenario (seeded by ``seed``) on ``checkpoint``, served with ``quantization`` (None: as its
    ``config.json`` says), and its reference from ``transformers`` on ``reference_dir``."""
    model = load_hf_model(reference_dir)
    specs = standard_specs(model.config.vocab_size, seed=seed)
    completions, logits = hf_reference(model, specs)
    plans, expected = build_plans(specs, completions, block_size, num_blocks, seed=seed)
    job = Job(name, str(checkpoint), tuple(plans), num_blocks, block_size, quantization=quantization)
    return QuantizedCase(job, expected, completions, logits)


def records_by_degree(jobs: Callable[[int], list[Job]]) -> Callable[[int], dict[str, list[StepRecord]]]:
    """``tp -> {job name: records}``, each degree's jobs (``jobs(tp)``) run once, in one process group."""
    cache: dict[int, dict[str, list[StepRecord]]] = {}

    def run(tp: int) -> dict[str, list[StepRecord]]:
        if tp not in cache:
            cache[tp] = run_jobs(jobs(tp), tp_size=tp)
        return cache[tp]

    return run


def case_jobs(cases: Mapping[str, QuantizedCase], tp1_only: Collection[str] = ()) -> Callable[[int], list[Job]]:
    """The cases' jobs at a degree: all at tp 1, those not in ``tp1_only`` above it."""
    return lambda tp: [case.job for name, case in cases.items() if tp == 1 or name not in tp1_only]


def check_case(case: QuantizedCase, records: list[StepRecord], bound: float) -> float:
    """Every step's sampled tokens equal ``transformers``' greedy ones and its logits are within ``bound``
    (absolute and relative); returns the largest logit difference.

    Raises:
        AssertionError: names the step.
    """
    assert len(records) == len(case.expected)
    worst = 0.0
    for step, (record, samples) in enumerate(zip(records, case.expected, strict=True)):
        assert record.sampled_token_ids == tuple(case.completions[s][i] for s, i in samples), f"step {step}"
        if samples:
            want = torch.stack([case.logits[s][i] for s, i in samples])  # (N, V)
            worst = max(worst, float((record.logits - want).abs().max()))
            torch.testing.assert_close(record.logits, want, atol=bound, rtol=bound, msg=lambda m: f"step {step}: {m}")
    return worst
