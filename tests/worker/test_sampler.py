"""Sampler: greedy equivalences, batch invariance of seeded sampling, empirical distributions."""

from __future__ import annotations

import pytest
import torch

from tpserve.step import SamplingParams
from worker.sampler import noise_seed, sample, splitmix64

PROBS = torch.tensor([0.5, 0.3, 0.2])
NUM_DRAWS = 4000  # binomial std <= sqrt(0.25 / 4000) ~ 0.008; tolerance 0.03 is ~4 std


def _logits(num_rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3  # (N, V)


def _frequencies(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Empirical distribution of one row sampled at positions 0..NUM_DRAWS-1 (one draw each)."""
    rows = logits.expand(NUM_DRAWS, -1)  # (D, V)
    tokens = sample(rows, [params] * NUM_DRAWS, list(range(NUM_DRAWS)))  # (D,)
    return torch.bincount(tokens, minlength=logits.shape[-1]).float() / NUM_DRAWS


def test_splitmix64_matches_reference_output() -> None:
    # First output of Vigna's splitmix64.c from state 0.
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert 0 <= noise_seed(2**64 - 1, 10**9) < 2**64


def test_greedy_rows_take_the_argmax() -> None:
    logits = _logits(4)
    tokens = sample(logits, [SamplingParams(temperature=0.0)] * 4, [0, 1, 2, 3])
    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize("seed", range(5))
def test_top_k_one_and_tiny_top_p_equal_greedy(seed: int) -> None:
    logits = _logits(6, seed=seed)
    greedy = logits.argmax(dim=-1)
    positions = list(range(10, 16))
    top_k_1 = [SamplingParams(temperature=1.5, top_k=1, seed=seed + i) for i in range(6)]
    top_p_tiny = [SamplingParams(temperature=1.5, top_p=1e-6, seed=seed + i) for i in range(6)]
    assert torch.equal(sample(logits, top_k_1, positions), greedy)
    assert torch.equal(sample(logits, top_p_tiny, positions), greedy)


def test_seeded_row_samples_the_same_alone_and_in_any_batch() -> None:
    logits = _logits(5, vocab=300)
    params = [
        SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, seed=2**64 - 1),
        SamplingParams(temperature=0.7, top_p=0.5, seed=11),
        SamplingParams(temperature=1.0, top_k=3, seed=99),
    ]
    positions = [17, 4, 250, 17, 0]
    batched = sample(logits, params, positions)
    for i in range(5):
        alone = sample(logits[i : i + 1], [params[i]], [positions[i]])
        assert int(alone[0]) == int(batched[i]), f"row {i}"
    reversed_batch = sample(logits.flip(0), params[::-1], positions[::-1])
    assert torch.equal(reversed_batch.flip(0), batched)


def test_noise_depends_on_seed_and_position() -> None:
    logits = torch.zeros(1, 1000)  # uniform: the token is decided by the noise alone
    params = SamplingParams(temperature=1.0, seed=5)
    by_position = {int(sample(logits, [params], [p])[0]) for p in range(20)}
    by_seed = {int(sample(logits, [SamplingParams(temperature=1.0, seed=s)], [3])[0]) for s in range(20)}
    assert len(by_position) > 15 and len(by_seed) > 15
    assert int(sample(logits, [params], [7])[0]) == int(sample(logits, [params], [7])[0])


def test_empirical_frequencies_follow_the_distribution() -> None:
    freq = _frequencies(PROBS.log()[None], SamplingParams(temperature=1.0, seed=123))
    torch.testing.assert_close(freq, PROBS, atol=0.03, rtol=0)


def test_temperature_scales_the_logits() -> None:
    logits = PROBS.log()[None]
    hot = _frequencies(logits, SamplingParams(temperature=2.0, seed=1))
    expected_hot = PROBS.sqrt() / PROBS.sqrt().sum()  # softmax(log p / 2) = p^(1/2), normalised
    torch.testing.assert_close(hot, expected_hot, atol=0.03, rtol=0)
    cold = _frequencies(logits, SamplingParams(temperature=0.05, seed=1))
    assert cold[0] > 0.99  # p^(20) puts ~all mass on the top token


def test_top_k_and_top_p_truncate_then_renormalise() -> None:
    logits = PROBS.log()[None]
    top_k = _frequencies(logits, SamplingParams(temperature=1.0, top_k=2, seed=3))
    torch.testing.assert_close(top_k, torch.tensor([0.625, 0.375, 0.0]), atol=0.03, rtol=0)
    assert top_k[2] == 0
    # Mass before token 2 is 0.5 < 0.7 (kept); before token 3 it is 0.8 >= 0.7 (dropped).
    top_p = _frequencies(logits, SamplingParams(temperature=1.0, top_p=0.7, seed=4))
    torch.testing.assert_close(top_p, torch.tensor([0.625, 0.375, 0.0]), atol=0.03, rtol=0)
    assert top_p[2] == 0


def test_sampled_tokens_stay_inside_the_top_k_set() -> None:
    logits = _logits(1, vocab=100)
    allowed = set(logits[0].topk(5).indices.tolist())
    tokens = sample(logits.expand(200, -1), [SamplingParams(temperature=3.0, top_k=5, seed=8)] * 200, list(range(200)))
    assert set(tokens.tolist()) <= allowed
    assert len(set(tokens.tolist())) == 5
