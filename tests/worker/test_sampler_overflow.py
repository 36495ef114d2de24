"""The sampler never returns a garbage token when ``logits / temperature`` overflows (docs/design/sampling.md, "Tiny
temperatures are greedy").

A positive float32 temperature small enough (2e-38 down to 1e-45) turns the
scaled logits into inf, softmax into NaN and the exponential race's argmax into
token 0. Such a row must take the greedy token; other rows keep their sample.
"""

from __future__ import annotations

import pytest
import torch

from tpserve.step import SamplingParams
from worker.sampler import sample


@pytest.mark.parametrize("temperature", [2e-38, 1e-38, 1e-45, 1e-30])
def test_a_tiny_temperature_gives_the_greedy_token(temperature: float) -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 10  # (3, 50) logits of a real model's size
    logits[:, 0] = -10.0  # token 0 is never the argmax: the old NaN path returned it
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(3)]
    tokens = sample(logits, params, positions=[4, 5, 6])
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_an_overflowing_row_does_not_change_its_neighbours() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(2)) * 3  # (2, 50)
    normal = SamplingParams(temperature=1.0, seed=7)
    alone = sample(logits[1:], [normal], positions=[3])
    together = sample(logits, [SamplingParams(temperature=1e-40, seed=1), normal], positions=[3, 3])
    assert together.tolist() == [int(logits[0].argmax()), int(alone[0])]
