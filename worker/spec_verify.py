"""Verification of proposed tokens (speculative decoding) on the sampling rank.

A chunk with ``k = num_spec_tokens`` proposals ``d_1 .. d_k`` feeds the sequence's
last token and the proposals in one forward pass; row ``j`` (0 .. k) of its last
``k + 1`` rows gives the target distribution ``p_j`` of the token at position
``start_position + j + 1``, conditioned on the proposals before it. The runner
samples every row exactly as it would sample that position without speculation
(:mod:`worker.sampler`: greedy rows take the argmax; sampled rows use the
counter-based noise of ``(seed, absolute position)``), giving ``t_0 .. t_k``.
The chunk keeps ``t_0 .. t_n`` where ``n`` is the number of leading proposals
with ``t_j == d_{j+1}``.

Why this is speculative sampling (Leviathan, Kalman and Matias 2023, "Fast
Inference from Transformers via Speculative Decoding", arXiv:2211.17192; Chen et
al. 2023, arXiv:2302.01318): the rule accepts a draft ``x ~ q`` with probability
``min(1, p(x) / q(x))`` and on rejection samples from ``norm(max(0, p - q))``.
The n-gram proposer is deterministic, so ``q`` is one-hot on ``x``: accept with
probability ``p(x)``, and on rejection sample from ``p`` with ``x`` removed,
renormalised. Drawing ``t ~ p`` and accepting iff ``t == x`` does exactly that:
``P(t == x) = p(x)``, and given ``t != x``, ``t`` is distributed as ``p`` without
``x``, renormalised. After ``k`` acceptances ``t_k`` is the bonus token. Greedy
rows are the ``temperature -> 0`` case: the longest prefix matching the argmax.

Because each ``t_j`` is the very sample the non-speculative path draws at that
position (same seed, same position, same noise), a seeded request gives the same
tokens with and without speculation whenever the verified logits equal the
decode logits, and the same tokens run twice in any case.

Host-side Python over the step's sampled tokens (already copied to the host).
"""

from __future__ import annotations

from collections.abc import Sequence

from tpserve.step import ScheduledChunk


def accept_proposals(samples: Sequence[ScheduledChunk], last_tokens: Sequence[int],
                     spec_tokens: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tokens each sampled chunk gives, and how many proposals each accepted.

    Args:
        samples: the step's chunks with ``sample=True``, in plan order.
        last_tokens: the token sampled at each one's last row, in the same order.
        spec_tokens: the tokens sampled at the ``num_spec_tokens`` rows before each
            last row, chunk after chunk (``StepInputs.spec_rows`` order).

    Returns:
        ``(token_ids, num_accepted)``: per chunk, its ``num_accepted + 1`` tokens
        concatenated in plan order, and ``num_accepted`` per chunk.

    Raises:
        ValueError: ``spec_tokens`` does not hold one token per proposal.
    """
    if len(spec_tokens) != sum(chunk.num_spec_tokens for chunk in samples) or len(last_tokens) != len(samples):
        raise ValueError(f"{len(spec_tokens)} verification tokens and {len(last_tokens)} samples "
                         f"for {len(samples)} chunks")
    token_ids: list[int] = []
    num_accepted: list[int] = []
    offset = 0
    for chunk, last in zip(samples, last_tokens):
        k = chunk.num_spec_tokens
        targets = list(spec_tokens[offset:offset + k]) + [last]  # t_0 .. t_k
        offset += k
        proposals = chunk.token_ids[len(chunk.token_ids) - k:]  # d_1 .. d_k
        n = 0
        while n < k and targets[n] == proposals[n]:
            n += 1
        token_ids.extend(targets[:n + 1])  # the accepted proposals, then the correction (or the bonus)
        num_accepted.append(n)
    return tuple(token_ids), tuple(num_accepted)
