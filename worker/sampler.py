"""Batched token sampling on rank 0: one pass on the logits' device, reproducible per request.

For each row of logits (one per chunk with ``sample=True``):

* greedy rows (``temperature == 0``): ``argmax(logits)``;
* sampled rows, in the order of ``transformers``' logits warpers and vLLM's sampler:
  1. temperature: ``logits / temperature``;
  2. top-k: keep the ``top_k`` largest logits (ties at the boundary broken by
     token id, through a stable sort);
  3. top-p (nucleus, Holtzman et al. 2019, arXiv:1904.09751): over the top-k
     distribution sorted in decreasing order, keep the smallest prefix whose
     probability sum reaches ``top_p`` (a token is dropped when the mass before
     it is already ``>= top_p``; the most likely token always stays);
  4. ``p = softmax(logits)`` and token ``= argmax_i p_i / E_i`` with ``E_i ~ Exp(1)``
     i.i.d. The "exponential race": ``E_i / p_i ~ Exp(p_i)`` and the smallest of
     independent exponentials is ``i`` with probability ``p_i / sum_j p_j``; it is
     the Gumbel-max trick in another guise (Gumbel 1954; Maddison, Tarlow and
     Minka 2014, "A* Sampling"), as in vLLM's ``random_sample``.

The noise is counter-based: ``E[i, v]`` is a pure function of the request's
seed, the absolute position of the token being sampled and the token id ``v``
(:func:`exponential_noise`), computed for the whole ``(N, V)`` batch at once with
64-bit integer tensor arithmetic (splitmix64: Steele, Lea and Flood 2014, "Fast
splittable pseudorandom number generators"; constants from Vigna's
``splitmix64.c``). No ``torch.Generator``, no per-row loop, no host sync: the
whole sampler is a fixed sequence of tensor operations (capturable by a CUDA
graph). Because the noise of a row depends on nothing else in the batch, a
seeded request samples the same tokens alone or in any batch, at any
tensor-parallel degree (rank 0 samples from the gathered full-vocabulary
logits), and after a preemption (recompute reaches the same positions). Integer
arithmetic wraps identically everywhere, so the noise itself is bit-identical
on the CPU and on CUDA; whether the *tokens* are depends on the logits (see
docs/design.md, "Precision and reproducibility").

Before all this, rows that ask for them get vLLM's other controls (logit_bias,
min_tokens, repetition / presence / frequency penalties, then min_p after the
temperature; :mod:`worker.logits_controls`); a batch where no row does skips them.

Entry points: :func:`sample` (per-row :class:`~tpserve.step.SamplingParams`) and
:func:`sample_tensors` (prebuilt ``(N,)`` tensors, for a runner that keeps them
on the device between steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tpserve.step import SamplingParams
from worker.logits_controls import LogitsControls, apply_logits_controls, apply_min_p

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment (2**64 / golden ratio)
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
#: Bits of a hash kept for the uniform: 23, so that ``m + 0.5`` is exact in float32
#: and ``u = (m + 0.5) / 2**23`` lies in ``[2**-24, 1 - 2**-24]`` (never 0 or 1).
_UNIFORM_BITS = 23


def _as_int64(x: int) -> int:
    """The signed int64 with the same 64-bit pattern as the unsigned ``x``."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def splitmix64(x: int) -> int:
    """Reference splitmix64 step on Python ints: a bijective 64-bit mix of ``x`` (mod 2**64)."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def _shift_right(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic: it copies the sign)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`splitmix64` elementwise on an int64 tensor of bit patterns (wrapping arithmetic).

    Args:
        x: int64 tensor, any shape; values are read as unsigned 64-bit patterns.

    Returns:
        int64 tensor of the same shape: the bit patterns of ``splitmix64(x)``.
    """
    x = x + _as_int64(_GOLDEN)
    x = (x ^ _shift_right(x, 30)) * _as_int64(_MIX1)
    x = (x ^ _shift_right(x, 27)) * _as_int64(_MIX2)
    return x ^ _shift_right(x, 31)


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``(N, V)`` float32 ``Exp(1)`` noise; entry ``[i, v]`` depends only on ``(seeds[i], positions[i], v)``.

    ``key = splitmix64(splitmix64(seed) ^ position)``; token ``v`` takes the
    ``(v + 1)``-th output of the splitmix64 stream seeded ``key``, i.e.
    ``h = mix(key + (v + 1) * golden)``; its top 23 bits give ``u`` in ``(0, 1)``
    and the noise is ``-log(u)``.

    Args:
        seeds: ``(N,) int64`` the requests' unsigned seeds as bit patterns.
        positions: ``(N,) int64`` absolute position of the token each row samples.
        vocab_size: ``V``.

    Returns:
        ``(N, V)`` float32 on ``seeds.device``, every value in ``[6e-8, 16.7]``.
    """
    key = splitmix64_tensor(splitmix64_tensor(seeds) ^ positions)  # (N,)
    counter = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device) * _as_int64(_GOLDEN)  # (V,) v * golden
    bits = splitmix64_tensor(key[:, None] + counter[None, :])  # (N, V) mix(key + (v + 1) * golden)
    mantissa = _shift_right(bits, 64 - _UNIFORM_BITS).to(torch.float32)  # (N, V) integers in [0, 2**23)
    uniform = (mantissa + 0.5) * (2.0**-_UNIFORM_BITS)  # (N, V) in [2**-24, 1 - 2**-24], exact
    return -torch.log(uniform)  # (N, V) Exp(1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set filtered-out logits to ``-inf``.

    Args:
        logits: ``(N, V)`` float32, already divided by the temperature.
        top_k: ``(N,) int64``; ``0`` keeps all ``V``.
        top_p: ``(N,) float32`` in ``(0, 1]``; ``1`` keeps all.

    Returns:
        ``(N, V)`` float32, the kept logits unchanged.
    """
    vocab_size = logits.shape[-1]
    # Stable: equal logits keep token-id order, whatever the batch around them.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # (N, V), (N, V)
    rank = torch.arange(vocab_size, device=logits.device)  # (V,)
    k = torch.where(top_k > 0, top_k, vocab_size)  # (N,)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= k[:, None], float("-inf"))  # (N, V)
    sorted_probs = sorted_logits.softmax(dim=-1)  # (N, V)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (N, V) probability of better tokens
    # top_p == 1 keeps everything (float rounding could otherwise drop a tail token).
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # (N, V)
    drop[:, 0] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))  # (N, V)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)  # (N, V) original order


@dataclass(frozen=True)
class SamplingTensors:
    """The sampling parameters of a batch's ``N`` rows, as device tensors.

    Attributes:
        temperature: ``(N,) float32``; 0 marks a greedy row.
        top_k: ``(N,) int64``; 0 disables the filter.
        top_p: ``(N,) float32`` in ``(0, 1]``.
        seeds: ``(N,) int64``, the unsigned 64-bit seeds as bit patterns.
        positions: ``(N,) int64``, absolute position of each row's sampled token.
        all_greedy: host-side hint: every row is greedy (skip the noise).
        any_truncation: host-side hint: some row has ``top_k > 0`` or ``top_p < 1``
            (else skip the sort).
        controls: logit_bias, min_tokens, penalties and min_p of the rows that use
            them; None (nothing to do) when no row does.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    all_greedy: bool
    any_truncation: bool
    controls: LogitsControls | None = None

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], positions: Sequence[int], device: torch.device | str
    ) -> SamplingTensors:
        """Pack per-row parameters into two host tensors and copy each to ``device`` once."""
        floats = torch.tensor([(p.temperature, p.top_p) for p in params], dtype=torch.float32).view(-1, 2)  # (N, 2)
        ints = torch.tensor(
            [(p.top_k, _as_int64(p.seed), pos) for p, pos in zip(params, positions, strict=True)], dtype=torch.int64
        ).view(-1, 3)  # (N, 3)
        floats = floats.to(device, non_blocking=True)
        ints = ints.to(device, non_blocking=True)
        return cls(
            temperature=floats[:, 0], top_p=floats[:, 1], top_k=ints[:, 0], seeds=ints[:, 1], positions=ints[:, 2],
            all_greedy=all(p.greedy for p in params),
            any_truncation=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
        )


def sample_tensors(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """Pick one token per row; no host sync, no per-row work.

    Args:
        logits: ``(N, V)`` float32 (any float dtype is upcast).
        sampling: the rows' parameters, on ``logits.device``.

    Returns:
        ``(N,) int64`` token ids, on ``logits.device``.
    """
    logits = logits.float()  # (N, V)
    controls = sampling.controls
    if controls is not None:
        logits = apply_logits_controls(logits, controls)  # (N, V) bias, min_tokens, penalties: before any argmax
    greedy_tokens = logits.argmax(dim=-1)  # (N,)
    if sampling.all_greedy:
        return greedy_tokens
    is_sampled = sampling.temperature > 0  # (N,)
    temperature = torch.where(is_sampled, sampling.temperature, 1.0)  # (N,) no division by 0
    scaled = logits / temperature[:, None]  # (N, V)
    if controls is not None and controls.min_p is not None:
        scaled = apply_min_p(scaled, controls.min_p)  # (N, V)
    if sampling.any_truncation:
        scaled = apply_top_k_top_p(scaled, sampling.top_k, sampling.top_p)  # (N, V)
    probs = scaled.softmax(dim=-1)  # (N, V)
    noise = exponential_noise(sampling.seeds, sampling.positions, logits.shape[-1])  # (N, V)
    sampled_tokens = (probs / noise).argmax(dim=-1)  # (N,) exponential race
    # A row whose scaled logits overflowed (a tiny temperature: logits / 1e-38 = inf,
    # softmax NaN, argmax 0) takes the greedy token, never a garbage one. No host sync.
    finite = torch.isfinite(probs).all(dim=-1)  # (N,)
    return torch.where(is_sampled & finite, sampled_tokens, greedy_tokens)  # (N,)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``(N, V)`` float32 (any float dtype is upcast).
        params: the sampling parameters of each row's request.
        positions: absolute position each row's token will occupy in its sequence
            (``start_position + num_tokens`` of the chunk).

    Returns:
        ``(N,) int64`` token ids, on ``logits.device``.
    """
    return sample_tensors(logits, SamplingTensors.from_params(params, positions, logits.device))
