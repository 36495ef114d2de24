"""OLMo 2 at tensor-parallel degrees 1, 2 and 4 against ``transformers``, and its full-width QK norm rank by rank.

A tiny seeded ``olmo2`` checkpoint: post-norms (no input norm), a QK norm over all heads'
q (resp. k) at once with random weights, q/k/v/o biases (``attention_bias``), head_dim 32
(hidden 64: not hidden / heads), 2 KV heads (split at degree 2, replicated at degree 4,
where the norm's sum over ranks counts each replica). It runs the scenario of
tests/worker/family_check.py (chunked prefill, prefix-cache hits, preemption, prompt logprobs).
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import TinyModelSpec
from tests.worker.family_check import check, register

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

OLMO2 = register(TinyModelSpec("olmo2", "olmo2", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 190, "attention_bias": True,
}, seed=41), None)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_olmo2_matches_transformers(tp: int) -> None:
    check(OLMO2, tp)


class _SummingGroup:
    """A stand-in for a tensor-parallel group inside one process: ``all_reduce`` returns the sum of every
    rank's tensor, which the test supplies (the ranks' partial sums computed beforehand)."""

    def __init__(self, tp_size: int, total: torch.Tensor) -> None:
        self.tp_size, self.total = tp_size, total

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.total.clone()


@pytest.mark.parametrize("tp", [2, 4])
def test_full_width_qk_norm_at_tp_equals_the_whole_norm(tp: int) -> None:
    """Each rank's normalised q and k columns, over 4 q heads and 2 KV heads (replicated at tp 4), equal the
    columns of transformers' ``Olmo2RMSNorm`` over the whole projection."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from worker.layers.qk_norm import FullWidthRMSNorm, full_width_qk_norm

    num_heads, num_kv_heads, d, tokens, eps = 4, 2, 8, 5, 1e-6
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, n * d, generator=generator) for n in (num_heads, num_kv_heads, num_kv_heads))
    q_ref, k_ref = Olmo2RMSNorm(num_heads * d, eps), Olmo2RMSNorm(num_kv_heads * d, eps)
    with torch.no_grad():
        q_ref.weight.copy_(1 + 0.3 * torch.randn(num_heads * d, generator=generator))
        k_ref.weight.copy_(1 + 0.3 * torch.randn(num_kv_heads * d, generator=generator))
        want_q, want_k = q_ref(q), k_ref(k)
    heads, kv_heads = num_heads // tp, max(1, num_kv_heads // tp)
    kv_start = [r * kv_heads if tp <= num_kv_heads else r // (tp // num_kv_heads) for r in range(tp)]
    norms, parts = [], []
    for r in range(tp):
        q_norm = FullWidthRMSNorm(num_heads * d, r * heads * d, heads * d, eps, dtype=torch.float32,
                                  device=torch.device("cpu"))
        k_norm = FullWidthRMSNorm(num_kv_heads * d, kv_start[r] * d, kv_heads * d, eps, dtype=torch.float32,
                                  device=torch.device("cpu"))
        q_norm.load_weight(q_norm.weight, q_ref.weight.detach())
        k_norm.load_weight(k_norm.weight, k_ref.weight.detach())
        kv_cols = slice(kv_start[r] * d, (kv_start[r] + kv_heads) * d)
        parts.append(torch.cat([q[:, r * heads * d:(r + 1) * heads * d], k[:, kv_cols], v[:, kv_cols]], dim=-1))
        norms.append((q_norm, k_norm, kv_cols))
    q_size, kv_size = heads * d, kv_heads * d
    total = sum(torch.stack([p[:, :q_size].pow(2).sum(-1), p[:, q_size:q_size + kv_size].pow(2).sum(-1)], -1)
                for p in parts)
    for r, (part, (q_norm, k_norm, kv_cols)) in enumerate(zip(parts, norms, strict=True)):
        out = full_width_qk_norm(part, q_norm, k_norm, _SummingGroup(tp, total))  # type: ignore[arg-type]
        torch.testing.assert_close(out[:, :q_size], want_q[:, r * q_size:(r + 1) * q_size], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out[:, q_size:q_size + kv_size], want_k[:, kv_cols], atol=1e-6, rtol=1e-6)
        assert torch.equal(out[:, q_size + kv_size:], part[:, q_size + kv_size:])  # v untouched
