"""Batched token sampling on rank 0, reproducible per request.

For each row of logits (one per chunk with ``sample=True``):

* greedy rows (``temperature == 0``): ``argmax(logits)``;
* sampled rows, in the order of ``transformers``' logits warpers and vLLM's sampler:
  1. temperature: ``logits / temperature``;
  2. top-k: keep the ``top_k`` largest logits (ties at the boundary broken by sort order);
  3. top-p (nucleus, Holtzman et al. 2019, arXiv:1904.09751): over the top-k
     distribution sorted in decreasing order, keep the smallest prefix whose
     probability sum reaches ``top_p`` (a token is dropped when the mass before
     it is already ``>= top_p``; the most likely token always stays);
  4. ``p = softmax(logits)`` and token ``= argmax_i p_i / E_i`` with ``E_i ~ Exp(1)``
     i.i.d. The "exponential race": ``E_i / p_i ~ Exp(p_i)`` and the smallest of
     independent exponentials is ``i`` with probability ``p_i / sum_j p_j``; it is
     the Gumbel-max trick in another guise (Gumbel 1954; Maddison, Tarlow and
     Minka 2014, "A* Sampling"), as in vLLM's ``random_sample``.

The noise ``E`` of a row comes from its own ``torch.Generator`` seeded with
``noise_seed(seed, position)``, a splitmix64 mix (Steele, Lea and Flood 2014,
"Fast splittable pseudorandom number generators"; constants from Vigna's
``splitmix64.c``) of the request's seed and the absolute position of the token
being sampled. A request therefore samples the same tokens alone or in any
batch, at any tensor-parallel degree, and after a preemption. (The generator
runs on the logits' device: CPU and CUDA generators give different streams, so
the guarantee holds per device type.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tpserve.step import SamplingParams

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One splitmix64 step: a bijective 64-bit mix of ``x`` (unsigned, mod 2**64)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, position: int) -> int:
    """64-bit generator seed for the token at absolute ``position`` of a request seeded ``seed``."""
    return splitmix64(splitmix64(seed & _MASK64) ^ (position & _MASK64))


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
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (N, V), (N, V)
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


def exponential_noise(
    seeds: Sequence[int], positions: Sequence[int], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``(N, V)`` float32 i.i.d. ``Exp(1)`` noise, row ``i`` from ``noise_seed(seeds[i], positions[i])``."""
    rows = []
    for seed, position in zip(seeds, positions, strict=True):
        generator = torch.Generator(device=device)
        generator.manual_seed(noise_seed(seed, position))
        rows.append(torch.empty(vocab_size, device=device).exponential_(generator=generator))  # (V,)
    # exponential_ may return exactly 0 in float32; keep the race well defined.
    return torch.stack(rows).clamp_min_(torch.finfo(torch.float32).tiny)  # (N, V)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``(N, V)`` float32 (any float dtype is upcast).
        params: the sampling parameters of each row's request.
        positions: absolute position each row's token will occupy in its sequence
            (``start_position + num_tokens`` of the chunk).

    Returns:
        ``(N,) int64`` token ids, on ``logits.device``.
    """
    logits = logits.float()  # (N, V)
    tokens = logits.argmax(dim=-1)  # (N,) greedy answer for every row
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    device = logits.device
    chosen = [params[i] for i in rows]
    index = torch.tensor(rows, device=device)  # (M,)
    temperature = torch.tensor([p.temperature for p in chosen], device=device)  # (M,)
    top_k = torch.tensor([p.top_k for p in chosen], device=device)  # (M,)
    top_p = torch.tensor([p.top_p for p in chosen], device=device)  # (M,)
    scaled = logits[index] / temperature[:, None]  # (M, V)
    probs = apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)  # (M, V)
    noise = exponential_noise([p.seed for p in chosen], [positions[i] for i in rows], logits.shape[-1], device)
    tokens[index] = (probs / noise).argmax(dim=-1)  # (M,) exponential race
    return tokens
