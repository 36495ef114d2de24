"""bfloat16 at tensor-parallel degrees 1 and 2 (gloo) against ``transformers`` in bfloat16.

Cases and the stated tolerance: tests/worker/bf16_reference.py. Two tiny
checkpoints: GQA with tied embeddings; MQA (its one KV head replicated at degree
2) with an untied head and biases.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker.bf16_reference import Bf16Case, bf16_cases, check_bf16
from tests.worker.tp_harness import run_jobs

MODELS = ("gqa_tied", "mqa_untied_bias")


@pytest.fixture(scope="module")
def cases(tiny_checkpoints: dict[str, Path]) -> dict[str, Bf16Case]:
    return bf16_cases(tiny_checkpoints, MODELS)


@pytest.mark.parametrize("tp", [1, 2])
def test_bf16_logits_match_transformers_bf16(tp: int, cases: dict[str, Bf16Case]) -> None:
    records = run_jobs([case.job for case in cases.values()], tp_size=tp)
    for name, case in cases.items():
        worst = check_bf16(case, records[name], f"{name} tp={tp}")
        print(f"{name} tp={tp}: worst |ours - hf_bf16| = {worst:.4f}")
