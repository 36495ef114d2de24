"""Sampler: the counter-based noise, greedy equivalences, batch invariance, and chi-squared tests.

The chi-squared tests draw 20,000 tokens through the real sampler (one batched
call; row ``i`` samples at position ``i``, or with seed ``i``) and compare the
counts with the exact probabilities (goodness of fit) and with 20,000 draws of
``torch.multinomial`` (two-sample homogeneity). The sampler is deterministic,
so each statistic is a fixed number; the thresholds are the chi-squared
distribution's 0.999 quantiles (standard tables; df 63 by the Wilson-Hilferty
approximation), which a correct sampler exceeds with probability 0.001 per test.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from tpserve.step import SamplingParams
from worker.kernels import _cpu_supports_avx2, cpu_kernels_available
from worker.sampler import (
    SamplingTensors,
    apply_top_k,
    apply_top_k_top_p,
    exponential_noise,
    exponential_race,
    sample,
    sample_tensors,
    splitmix64,
    splitmix64_tensor,
    sampling_uniform,
)

NUM_DRAWS = 20_000
#: Upper 0.001 quantiles of chi-squared, by degrees of freedom.
CHI2_999 = {3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 9: 27.877, 63: 103.5}
PROBS = torch.tensor([0.22, 0.18, 0.14, 0.12, 0.1, 0.08, 0.06, 0.05, 0.03, 0.02], dtype=torch.float64)


def _logits(num_rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3  # (N, V)


def _draw(logits: torch.Tensor, params: SamplingParams, *, vary: str = "position") -> torch.Tensor:
    """NUM_DRAWS tokens from one row: row i at position i (or seed i at position 5). Returns counts (V,)."""
    rows = logits.float().expand(NUM_DRAWS, -1)  # (D, V)
    if vary == "position":
        tokens = sample(rows, [params] * NUM_DRAWS, list(range(NUM_DRAWS)))  # (D,)
    else:
        each = [SamplingParams(params.temperature, params.top_k, params.top_p, seed=i) for i in range(NUM_DRAWS)]
        tokens = sample(rows, each, [5] * NUM_DRAWS)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double()  # (V,)


def _goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; tokens of probability 0 must never be drawn."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token of probability 0 was sampled"
    expected = probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def _homogeneity(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """Two-sample chi-squared for equal sample sizes: sum (a - b)^2 / (a + b) over drawn tokens."""
    seen = (a + b) > 0
    return float(((a[seen] - b[seen]) ** 2 / (a[seen] + b[seen])).sum()), int(seen.sum()) - 1


def _truncated(probs: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Exact float64 probabilities after temperature, top-k and top-p, written from the definitions."""
    p = probs ** (1.0 / temperature)  # softmax(log p / T), unnormalised
    order = p.argsort(descending=True).tolist()
    top = order[: top_k or len(order)]
    mass_of_top = float(p[top].sum())  # top-p works on the top-k distribution, renormalised
    kept, mass = [], 0.0
    for token in top:
        if kept and mass >= top_p:
            break
        kept.append(token)
        mass += float(p[token]) / mass_of_top
    out = torch.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()


def test_tensor_mix_matches_the_reference_splitmix64() -> None:
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # first output of Vigna's splitmix64.c from state 0
    rng = random.Random(0)
    values = [0, 1, 2**63 - 1, 2**63, 2**64 - 1] + [rng.getrandbits(64) for _ in range(200)]
    signed = torch.tensor([v - 2**64 if v >= 2**63 else v for v in values], dtype=torch.int64)
    mixed = [int(x) % 2**64 for x in splitmix64_tensor(signed)]
    assert mixed == [splitmix64(v) for v in values]


def test_noise_is_a_function_of_seed_position_and_token_only() -> None:
    seeds = torch.tensor([3, 3, -1, 3], dtype=torch.int64)
    positions = torch.tensor([7, 8, 7, 7], dtype=torch.int64)
    noise = exponential_noise(seeds, positions, 300)  # (4, 300)
    assert noise.dtype == torch.float32 and noise.shape == (4, 300)
    assert torch.equal(noise[0], noise[3])  # same (seed, position): same noise, whatever the row
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert torch.equal(exponential_noise(seeds[:1], positions[:1], 100)[0], noise[0, :100])  # vocab-size free
    assert float(noise.min()) > 0 and torch.isfinite(noise).all()
    wide = exponential_noise(torch.arange(50), torch.zeros(50, dtype=torch.int64), 2000)  # 100,000 draws
    assert abs(float(wide.mean()) - 1.0) < 0.01 and abs(float(wide.var()) - 1.0) < 0.03  # Exp(1): mean 1, var 1


@pytest.mark.skipif(not (_cpu_supports_avx2() and shutil.which("c++")), reason="needs an AVX2 CPU and a C++ compiler")
def test_the_compiled_noise_and_race_equal_the_tensor_ops_bit_for_bit() -> None:
    assert cpu_kernels_available()
    seeds = torch.tensor([0, 1, -1, 2**62, -(2**63), 12345], dtype=torch.int64)
    positions = torch.tensor([0, 7, 4095, 1, 99, 2**40], dtype=torch.int64)
    uniform = sampling_uniform(seeds, positions, 5000)  # (6, 5000) worker/kernels/cpu_sampling.cpp
    assert torch.equal(uniform, sampling_uniform(seeds, positions, 5000, kernel=False))  # the int64 tensor ops
    probs = (torch.randn(6, 5000, generator=torch.Generator().manual_seed(1)) * 4).softmax(dim=-1)  # (6, V)
    probs[1] = 0.0  # every quotient 0: the first token, as torch's argmax
    probs[2, 17] = float("nan")
    probs[3, 4999] = float("inf")
    noise = uniform.log().neg()
    tokens, finite = exponential_race(probs, seeds, positions)
    assert finite.tolist() == [True, True, False, False, True, True]
    expected = (probs / noise).argmax(dim=-1)
    assert torch.equal(tokens[finite], expected[finite]) and int(tokens[1]) == 0


def test_greedy_rows_take_the_argmax() -> None:
    logits = _logits(4)
    tokens = sample(logits, [SamplingParams(temperature=0.0)] * 4, [0, 1, 2, 3])
    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize("seed", range(3))
def test_top_k_one_and_tiny_top_p_equal_greedy(seed: int) -> None:
    logits = _logits(6, seed=seed)
    greedy = logits.argmax(dim=-1)
    positions = list(range(10, 16))
    top_k_1 = [SamplingParams(temperature=1.5, top_k=1, seed=seed + i) for i in range(6)]
    top_p_tiny = [SamplingParams(temperature=1.5, top_p=1e-6, seed=seed + i) for i in range(6)]
    assert torch.equal(sample(logits, top_k_1, positions), greedy)
    assert torch.equal(sample(logits, top_p_tiny, positions), greedy)


def test_seeded_rows_sample_the_same_alone_and_in_a_batch_of_8() -> None:
    logits = _logits(8, vocab=300)
    params = [
        SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, seed=2**64 - 1),
        SamplingParams(temperature=0.7, top_p=0.5, seed=11),
        SamplingParams(temperature=1.0, top_k=3, seed=99),
        SamplingParams(temperature=2.0, seed=0),
        SamplingParams(temperature=1.0, seed=2**63),
        SamplingParams(temperature=0.5, top_k=100, seed=12345),
    ]
    positions = [17, 4, 250, 17, 0, 1, 3, 511]
    batched = sample(logits, params, positions)
    for i in range(8):
        alone = sample(logits[i : i + 1], [params[i]], [positions[i]])
        assert int(alone[0]) == int(batched[i]), f"row {i}"
    reversed_batch = sample(logits.flip(0), params[::-1], positions[::-1])
    assert torch.equal(reversed_batch.flip(0), batched)
    # A row without top-k/top-p gives the same token whether or not its batch needed the sort.
    assert int(sample(logits[2:3], [params[2]], [positions[2]])[0]) == int(batched[2])


@pytest.mark.parametrize("seed", range(3))
def test_top_k_without_a_sort_keeps_what_the_stable_sort_keeps(seed: int) -> None:
    # Logits rounded to halves: many ties at the k-th value, where the stable sort keeps the lowest ids.
    logits = (_logits(6, vocab=64, seed=seed) * 2).round() / 2  # (6, 64)
    logits[5, 10:] = float("-inf")  # a row with fewer finite logits than its k
    top_k = torch.tensor([1, 5, 0, 17, 64, 40])
    by_sort = apply_top_k_top_p(logits, top_k, torch.ones(6))
    without = apply_top_k_top_p(logits, top_k, torch.ones(6), k_max=64, any_top_p=False)
    assert torch.equal(without, by_sort)
    small = top_k.clamp(max=17)  # k_max below the vocabulary: the topk path proper
    assert torch.equal(apply_top_k(logits, small, 17), apply_top_k_top_p(logits, small, torch.ones(6)))
    assert (by_sort[1] > float("-inf")).sum() == 5
    # top-p over top-k candidates found by topk: bit for bit the full sort's, ties included.
    top_k, top_p = torch.tensor([3, 5, 17, 40, 1, 60]), torch.tensor([0.5, 0.9, 0.7, 0.95, 0.3, 0.99])
    by_sort = apply_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(apply_top_k_top_p(logits, top_k, top_p, k_max=60), by_sort)
    assert torch.equal(apply_top_k_top_p(logits[1:2], top_k[1:2], top_p[1:2], k_max=5), by_sort[1:2])  # alone
    assert ((by_sort > float("-inf")).sum(dim=-1) <= top_k).all()


def test_tensor_entry_point_equals_the_params_entry_point() -> None:
    logits = _logits(3, vocab=64)
    params = [SamplingParams(temperature=0.8, top_k=5, seed=1), SamplingParams(0.0), SamplingParams(1.1, seed=4)]
    tensors = SamplingTensors.from_params(params, [3, 9, 27], logits.device)
    assert tensors.seeds.dtype == torch.int64 and tensors.temperature.shape == (3,)
    assert torch.equal(sample_tensors(logits, tensors), sample(logits, params, [3, 9, 27]))


def test_noise_depends_on_seed_and_position() -> None:
    logits = torch.zeros(1, 1000)  # uniform: the token is decided by the noise alone
    params = SamplingParams(temperature=1.0, seed=5)
    by_position = {int(sample(logits, [params], [p])[0]) for p in range(20)}
    by_seed = {int(sample(logits, [SamplingParams(temperature=1.0, seed=s)], [3])[0]) for s in range(20)}
    assert len(by_position) > 15 and len(by_seed) > 15


@pytest.mark.parametrize("vary", ["position", "seed"])
def test_chi_squared_against_the_exact_probabilities_and_multinomial(vary: str) -> None:
    counts = _draw(PROBS.log()[None], SamplingParams(temperature=1.0, seed=123), vary=vary)
    statistic, dof = _goodness_of_fit(counts, PROBS)
    assert dof == 9 and statistic < CHI2_999[dof], statistic
    reference = torch.multinomial(PROBS, NUM_DRAWS, replacement=True, generator=torch.Generator().manual_seed(0))
    statistic, dof = _homogeneity(counts, torch.bincount(reference, minlength=len(PROBS)).double())
    assert statistic < CHI2_999[dof], statistic


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "dof"),
    [(0.7, 6, 1.0, 5), (1.3, 0, 0.8, 6), (1.0, 6, 0.7, 3)],
)
def test_chi_squared_after_temperature_top_k_top_p(temperature: float, top_k: int, top_p: float, dof: int) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=77)
    counts = _draw(PROBS.log()[None], params)
    statistic, got_dof = _goodness_of_fit(counts, _truncated(PROBS, temperature, top_k, top_p))
    assert got_dof == dof and statistic < CHI2_999[dof], statistic


def test_chi_squared_uniform_over_many_token_ids() -> None:
    counts = _draw(torch.zeros(1, 64), SamplingParams(temperature=1.0, seed=9))
    statistic, dof = _goodness_of_fit(counts, torch.full((64,), 1 / 64, dtype=torch.float64))
    assert statistic < CHI2_999[dof], statistic


def test_sampled_tokens_stay_inside_the_top_k_set() -> None:
    logits = _logits(1, vocab=100)
    allowed = set(logits[0].topk(5).indices.tolist())
    tokens = sample(logits.expand(200, -1), [SamplingParams(temperature=3.0, top_k=5, seed=8)] * 200, list(range(200)))
    assert set(tokens.tolist()) == allowed
