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
docs/design/sampling.md, "Precision and reproducibility").

Before all this, rows that ask for them get vLLM's other controls, each a logits
processor (grammar, logit_bias, min_tokens, penalties before the greedy argmax;
min_p and typical_p after the temperature; :mod:`worker.logits_processors`, whose ``ORDER`` is the
one place the order is declared); a batch where no row uses one skips them. Greedy-only
batches are one argmax; in a mixed batch the filters, softmax and noise run on the
sampled rows only.

Entry points: :func:`sample` (per-row :class:`~tpserve.step.SamplingParams`) and
:func:`sample_tensors` (prebuilt ``(N,)`` tensors, for a runner that keeps them
on the device between steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import is_

import torch

from tpserve.step import SamplingParams
from worker.kernels import cpu_kernels_available

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
    x = x + _as_int64(_GOLDEN)  # a new tensor: the ops below work in place on it
    x.bitwise_xor_(_shift_right(x, 30)).mul_(_as_int64(_MIX1))
    x.bitwise_xor_(_shift_right(x, 27)).mul_(_as_int64(_MIX2))
    return x.bitwise_xor_(_shift_right(x, 31))


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
    return sampling_uniform(seeds, positions, vocab_size).log_().neg_()  # (N, V) Exp(1)


def sampling_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, *,
                     kernel: bool = True) -> torch.Tensor:
    """:func:`exponential_noise`'s ``(N, V)`` float32 uniforms ``u``, before the ``-log``.

    On the CPU with the compiled kernels (and ``kernel``) one pass of
    worker/kernels/cpu_sampling.cpp; otherwise about fifteen int64 tensor ops. The bits are the same.
    """
    if kernel and _race_kernel(seeds.device):
        return torch.ops.tpserve_cpu.sampling_uniform(seeds, positions, vocab_size)  # (N, V)
    key = splitmix64_tensor(splitmix64_tensor(seeds) ^ positions)  # (N,)
    counter = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device) * _as_int64(_GOLDEN)  # (V,) v * golden
    bits = splitmix64_tensor(key[:, None] + counter[None, :])  # (N, V) mix(key + (v + 1) * golden)
    uniform = _shift_right(bits, 64 - _UNIFORM_BITS).to(torch.float32)  # (N, V) integers in [0, 2**23)
    return uniform.add_(0.5).mul_(2.0**-_UNIFORM_BITS)  # (N, V) in [2**-24, 1 - 2**-24], exact


def _race_kernel(device: torch.device) -> bool:
    """Whether the compiled sampling kernels (worker/kernels/cpu_sampling.cpp) serve ``device``."""
    return device.type == "cpu" and cpu_kernels_available()


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``argmax_v probs[i, v] / E[i, v]`` with :func:`exponential_noise`'s ``E``, and which rows are finite.

    On the CPU with the compiled kernels, one pass for the uniforms, torch's ``log_`` (so the
    noise keeps its bits) and one pass for the quotient's argmax and the finiteness check,
    without the ``(N, V)`` noise and quotient tensors; the same tokens as the tensor ops.

    Args:
        probs: ``(N, V)`` float32 probabilities.
        seeds, positions: ``(N,) int64``, as :func:`exponential_noise` takes them.

    Returns:
        ``(N,) int64`` the race's winners (meaningless in a non-finite row) and ``(N,) bool``
        whether every probability of the row is finite.
    """
    if _race_kernel(probs.device) and probs.dtype == torch.float32:
        log_u = sampling_uniform(seeds, positions, probs.shape[-1]).log_()  # (N, V)
        return torch.ops.tpserve_cpu.exponential_race(probs.contiguous(), log_u)
    noise = exponential_noise(seeds, positions, probs.shape[-1])  # (N, V)
    return (probs / noise).argmax(dim=-1), torch.isfinite(probs).all(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      k_max: int | None = None, any_top_p: bool = True) -> torch.Tensor:
    """Set filtered-out logits to ``-inf``: top-k, then top-p over the top-k distribution.

    Token order is the stable descending sort's (equal logits: lower token id first). The
    top-p mass is computed from ``softmax`` of the top-k-masked row in token order, gathered
    in that order and summed from the most likely, whichever way the candidates were found:
    a full sort, or (``k_max`` given) ``topk`` of ``k_max`` candidates, which gives each row
    bit for bit the same result, so a row keeps the same tokens in any batch.

    Args:
        logits: ``(N, V)`` float32, already divided by the temperature.
        top_k: ``(N,) int64``; ``0`` keeps all ``V``.
        top_p: ``(N,) float32`` in ``(0, 1]``; ``1`` keeps all.
        k_max: host-side hint: a bound on every row's kept tokens after top-k (the largest
            ``top_k``, when every row with ``top_p < 1`` has a ``top_k``); None: sort.
        any_top_p: host-side hint: some row has ``top_p < 1`` (else top-k alone).

    Returns:
        ``(N, V)`` float32, the kept logits unchanged.
    """
    vocab_size = logits.shape[-1]
    if k_max is not None and k_max < vocab_size:
        masked = apply_top_k(logits, top_k, k_max)  # (N, V)
        if not any_top_p:
            return masked
        candidates = masked.topk(k_max, dim=-1).indices.sort(dim=-1).values  # (N, k) by token id
        _, by_value = masked.gather(-1, candidates).sort(dim=-1, descending=True, stable=True)  # (N, k)
        order = candidates.gather(-1, by_value)  # (N, k) the stable sort's first k
    else:
        # Stable: equal logits keep token-id order, whatever the batch around them.
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # (N, V), (N, V)
        rank = torch.arange(vocab_size, device=logits.device)  # (V,)
        k = torch.where(top_k > 0, top_k, vocab_size)  # (N,)
        sorted_logits = sorted_logits.masked_fill(rank[None, :] >= k[:, None], float("-inf"))  # (N, V)
        masked = torch.empty_like(logits).scatter_(-1, order, sorted_logits)  # (N, V) token order
    sorted_probs = masked.softmax(dim=-1).gather(-1, order)  # (N, K) most likely first
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (N, K) probability of better tokens
    # top_p == 1 keeps everything (float rounding could otherwise drop a tail token).
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # (N, K)
    drop[:, 0] = False  # the most likely token always stays
    remove = torch.zeros_like(masked, dtype=torch.bool).scatter_(-1, order, drop)  # (N, V)
    return masked.masked_fill(remove, float("-inf"))  # (N, V)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Top-k alone, without a sort: keeps what the stable sort of :func:`apply_top_k_top_p` keeps.

    A row keeps its logits above its k-th largest value ``t`` (``torch.topk``), and of those
    equal to ``t`` the lowest token ids, as many as fill k (the stable sort's tie order).

    Args:
        logits: ``(N, V)`` float32.
        top_k: ``(N,) int64``; ``0`` keeps all ``V``.
        k_max: host-side: the largest ``top_k`` of the rows (no device sync).

    Returns:
        ``(N, V)`` float32, the kept logits unchanged.
    """
    vocab_size = logits.shape[-1]
    k_max = min(k_max, vocab_size)
    if k_max <= 0:  # every row keeps all
        return logits
    k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)  # (N,)
    kth = logits.topk(k_max, dim=-1).values.gather(-1, (k.clamp(max=k_max) - 1)[:, None])  # (N, 1)
    above = logits > kth  # (N, V)
    tied = logits == kth  # (N, V)
    room = k[:, None] - above.sum(dim=-1, keepdim=True)  # (N, 1) ties to keep, lowest ids first
    keep = above | (tied & (tied.cumsum(dim=-1) <= room)) | (k[:, None] >= vocab_size)  # (N, V)
    return logits.masked_fill(~keep, float("-inf"))  # (N, V)


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
        processors: the logits processors some row uses (worker/logits_processors.py), in
            their order; empty (nothing to do) when no row does.
        sampled_rows: ``(S,) int64`` the rows with ``temperature > 0`` when some rows are
            greedy and some not (the noise and the filters run on those only); None otherwise.
        k_max: host-side hint: the largest ``top_k`` of the sampled rows when every row with
            ``top_p < 1`` has a ``top_k`` (candidates by ``topk``, no sort); None otherwise.
        any_top_p: host-side hint: some sampled row has ``top_p < 1``.
        unit_temperature: host-side hint: every sampled row has ``temperature == 1`` (the
            division, ``x / 1 == x`` exactly, is skipped).
        dead_end_rows: the rows whose grammar allows no token (worker/grammar.py): their sampled
            token means nothing and the step reports ``GRAMMAR_DEAD_END_TOKEN_ID`` instead.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    all_greedy: bool
    any_truncation: bool
    processors: tuple = ()
    sampled_rows: torch.Tensor | None = None
    k_max: int | None = None
    any_top_p: bool = True
    unit_temperature: bool = False
    dead_end_rows: tuple[int, ...] = ()

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
        mixed = mixed_rows(params)
        return cls(
            temperature=floats[:, 0], top_p=floats[:, 1], top_k=ints[:, 0], seeds=ints[:, 1], positions=ints[:, 2],
            **host_hints(params), sampled_rows=None if mixed is None else torch.tensor(mixed).to(device),
        )


class SamplingCache:
    """The last decode batch's :class:`SamplingTensors`, reused while its rows keep their parameters.

    A sequence's :class:`~tpserve.step.SamplingParams` is one object for its whole life on the
    rank, so a step whose rows hold the same objects, in the same order, as the step before
    (a steady decode batch) has the same temperatures, top-k/top-p, seeds and hints: only the
    positions change. Kept between steps, as vLLM v1's persistent input batch keeps its sampling
    tensors, instead of packing and copying ``N`` rows of parameters every step (64 rows: about
    70 us of Python a step). The objects are compared by identity (cheap, and a re-registered
    sequence brings a new object).
    """

    def __init__(self) -> None:
        self._params: tuple[SamplingParams, ...] = ()
        self._tensors: SamplingTensors | None = None

    def tensors(self, params: Sequence[SamplingParams], positions: torch.Tensor,
                device: torch.device) -> SamplingTensors:
        """The rows' tensors on ``device``, with ``positions (N,) int64`` (of each row's sampled token)."""
        if self._tensors is None or len(params) != len(self._params) or not all(map(is_, params, self._params)):
            self._params = tuple(params)
            self._tensors = SamplingTensors.from_params(params, [0] * len(params), device)
        t = self._tensors
        return SamplingTensors(t.temperature, t.top_k, t.top_p, t.seeds, positions, t.all_greedy, t.any_truncation,
                               t.processors, t.sampled_rows, t.k_max, t.any_top_p, t.unit_temperature)


def mixed_rows(params: Sequence[SamplingParams]) -> list[int] | None:
    """The sampled (not greedy) rows when the batch has both kinds, else None."""
    sampled = [i for i, p in enumerate(params) if p.temperature != 0.0]  # not greedy
    return sampled if 0 < len(sampled) < len(params) else None


def host_hints(params: Sequence[SamplingParams]) -> dict:
    """:class:`SamplingTensors`' host-side hints (``all_greedy``, ``any_truncation``, ``k_max``, ``any_top_p``)."""
    sampled = [p for p in params if p.temperature != 0.0]  # not greedy
    if not sampled:
        return dict(all_greedy=True, any_truncation=False)
    any_top_p = any(p.top_p < 1.0 for p in sampled)
    k_max = max(p.top_k for p in sampled)
    bounded = k_max > 0 and not any(p.top_p < 1.0 and p.top_k == 0 for p in sampled)
    return dict(all_greedy=False, any_truncation=any_top_p or k_max > 0, k_max=k_max if bounded else None,
                any_top_p=any_top_p, unit_temperature=all(p.temperature == 1.0 for p in sampled))


def add_sampling(packer, floats: dict[str, list[float]], prefix: str, params: Sequence[SamplingParams],
                 positions: Sequence[int]) -> None:
    """Packs the sampling parameters of some rows under ``prefix`` into worker/step_inputs.py's one host-to-device
    copy (``positions``: of the token each row samples); :func:`packed_sampling_tensors` reads them back."""
    packer.add(prefix + "top_k", [p.top_k for p in params])
    packer.add(prefix + "seeds", [_as_int64(p.seed) for p in params])  # int64 bit patterns
    packer.add(prefix + "sample_positions", positions)
    mixed = mixed_rows(params)
    if mixed is not None:
        packer.add(prefix + "sampled_rows", mixed)
    packer.reserve(prefix + "temperature_top_p", len(params))  # float32 (temperature, top_p) per int64
    floats[prefix + "temperature_top_p"] = [x for p in params for x in (p.temperature, p.top_p)]


def packed_sampling_tensors(dev: dict[str, torch.Tensor], prefix: str,
                            params: Sequence[SamplingParams]) -> SamplingTensors:
    """The device views of what :func:`add_sampling` packed under ``prefix``."""
    pairs = dev[prefix + "temperature_top_p"].view(torch.float32)  # (2N,) float32
    return SamplingTensors(
        temperature=pairs[0::2], top_p=pairs[1::2], top_k=dev[prefix + "top_k"], seeds=dev[prefix + "seeds"],
        positions=dev[prefix + "sample_positions"], sampled_rows=dev.get(prefix + "sampled_rows"),
        **host_hints(params),
    )


def sample_tensors(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """Pick one token per row; no per-row work, and off the CPU no host sync.

    A batch without processors and all greedy is one argmax. In a batch with greedy and
    sampled rows, the temperature's filters, the softmax and the noise run on the sampled
    rows only (``sampling.sampled_rows``).

    Args:
        logits: ``(N, V)`` float32 (any float dtype is upcast).
        sampling: the rows' parameters, on ``logits.device``.

    Returns:
        ``(N,) int64`` token ids, on ``logits.device``.
    """
    logits = logits.float()  # (N, V)
    if sampling.processors:
        logits = logits.clone()  # (N, V) processors work in place; the caller's stay the model's (logprobs)
        for processor in sampling.processors:
            if not processor.after_temperature:
                logits = processor.apply(logits)  # (N, V) grammar, bias, min_tokens, penalties: before any argmax
    if sampling.all_greedy:
        return logits.argmax(dim=-1)  # (N,)
    # (N,) the greedy rows' tokens, and a sampled row's if it overflows; computed now where the greedy rows
    # need them or a processor below may rewrite ``logits`` in place, else only if a row overflows.
    rows = sampling.sampled_rows
    greedy_tokens = logits.argmax(dim=-1) if sampling.processors or rows is not None else None
    # (N,) bool; unused when every row samples at temperature 1 and none overflows (the common case)
    is_sampled = sampling.temperature > 0 if rows is not None or not sampling.unit_temperature else None
    if sampling.unit_temperature:  # every sampled row at temperature 1 (greedy rows' scaled logits go unused)
        scaled = logits  # (N, V)
    else:
        temperature = torch.where(is_sampled, sampling.temperature, 1.0)  # (N,) no division by 0
        scaled = logits / temperature[:, None]  # (N, V)
    for processor in sampling.processors:
        if processor.after_temperature:
            scaled = processor.apply(scaled)  # (N, V) min_p, typical_p
    top_k, top_p, seeds, positions = sampling.top_k, sampling.top_p, sampling.seeds, sampling.positions
    if rows is not None:  # greedy and sampled rows: the rest is the sampled rows' (S of them)
        scaled, top_k, top_p = scaled[rows], top_k[rows], top_p[rows]  # (S, V), (S,), (S,)
        seeds, positions, is_sampled = seeds[rows], positions[rows], is_sampled[rows]
    if sampling.any_truncation:
        scaled = apply_top_k_top_p(scaled, top_k, top_p, sampling.k_max, sampling.any_top_p)  # (S, V)
    probs = scaled.softmax(dim=-1)  # (S, V)
    # A row whose scaled logits overflowed (a tiny temperature: logits / 1e-38 = inf,
    # softmax NaN, argmax 0) takes the greedy token, never a garbage one (off the CPU without a host sync).
    sampled_tokens, finite = exponential_race(probs, seeds, positions)  # (S,), (S,)
    if rows is None:  # every row sampled: the greedy token only stands in for a row that overflowed
        # The common case; on the CPU no device to sync (a list scan: a 64-row tensor all() is a ~15 us reduction).
        if logits.device.type == "cpu" and all(finite.tolist()):
            return sampled_tokens  # (N,) (skips an (N, V) argmax: 64 rows of 1,024, about 80 us of a step)
        greedy_tokens = logits.argmax(dim=-1) if greedy_tokens is None else greedy_tokens  # (N,)
        is_sampled = sampling.temperature > 0 if is_sampled is None else is_sampled  # (N,)
        return torch.where(is_sampled & finite, sampled_tokens, greedy_tokens)  # (N,)
    return greedy_tokens.index_copy(0, rows, torch.where(finite, sampled_tokens, greedy_tokens[rows]))  # (N,)


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
