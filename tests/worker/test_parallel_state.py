"""ParallelContext and init_distributed: single-rank no-ops, validation, and the collective timeout."""

from __future__ import annotations

import pytest
import torch

from tests.worker.tp_harness import run_lost_rank
from worker.parallel_state import ParallelContext, init_distributed

TIMEOUT_S = 2.0


def test_single_rank_collectives_are_no_ops() -> None:
    ctx = init_distributed(0, 1, "tcp://127.0.0.1:1", "cpu", timeout_s=1.0)  # never contacted
    x = torch.arange(6.0).view(2, 3)
    assert ctx.all_reduce(x) is x
    assert ctx.gather_to_rank0(x) is x
    assert ctx.is_rank0 and ctx.group is None


def test_invalid_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="tp_rank=2 is outside"):
        ParallelContext(tp_rank=2, tp_size=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="timeout_s"):
        init_distributed(0, 1, "tcp://127.0.0.1:1", "cpu", timeout_s=0)


def test_hung_rank_fails_the_collective_instead_of_hanging() -> None:
    outcome, seconds = run_lost_rank(TIMEOUT_S)
    assert outcome.startswith("RuntimeError") and "Timed out" in outcome, outcome
    assert TIMEOUT_S * 0.5 <= seconds < TIMEOUT_S * 5
