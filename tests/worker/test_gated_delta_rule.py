"""The gated delta rule (worker/layers/gated_delta_rule.py) against ``transformers``' reference forms, and its two forms
against each other.

The reference is ``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule`` of modeling_qwen3_next.py
(L2-normalisation inside, queries scaled by ``d_k ** -0.5``, grouped value heads). Inputs are drawn as the model
makes them: ``g = -exp(A_log) * softplus(a + dt_bias)`` (a few of them large, so the state decays fast) and
``beta = sigmoid(b)``; 2 key heads serve 4 value heads, with a non-zero initial state.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.layers.gated_delta_rule import chunked, recurrent_step

pytest.importorskip("transformers")
from transformers.models.qwen3_next.modeling_qwen3_next import (  # noqa: E402
    torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)

NUM_K_HEADS, NUM_V_HEADS, D_K, D_V = 2, 4, 16, 8


def _inputs(length: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, NUM_K_HEADS, D_K, generator=gen)
    k = torch.randn(length, NUM_K_HEADS, D_K, generator=gen)
    v = torch.randn(length, NUM_V_HEADS, D_V, generator=gen)
    a_log = torch.randn(NUM_V_HEADS, generator=gen)
    g = -a_log.exp() * F.softplus(torch.randn(length, NUM_V_HEADS, generator=gen) + 0.5)
    beta = torch.sigmoid(torch.randn(length, NUM_V_HEADS, generator=gen))
    state = 0.3 * torch.randn(NUM_V_HEADS, D_K, D_V, generator=gen)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state}


def _ours(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our layer's inputs: q, k L2-normalised (the reference's eps) and expanded to the value heads; q scaled."""
    groups = NUM_V_HEADS // NUM_K_HEADS
    q = x["q"] * torch.rsqrt((x["q"] ** 2).sum(-1, keepdim=True) + 1e-6) * D_K ** -0.5
    k = x["k"] * torch.rsqrt((x["k"] ** 2).sum(-1, keepdim=True) + 1e-6)
    return (q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1), x["v"], x["g"], x["beta"])


def _reference(fn, x: dict[str, torch.Tensor], **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    o, s = fn(x["q"][None], x["k"][None], x["v"][None], g=x["g"][None], beta=x["beta"][None],
              initial_state=x["state"][None], output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs)
    return o[0], s[0]


@pytest.mark.parametrize("length", [1, 5, 64, 65, 150])
def test_chunked_matches_the_reference_chunked_form(length: int) -> None:
    x = _inputs(length, seed=length)
    o, s = chunked(*_ours(x), x["state"])
    ref_o, ref_s = _reference(torch_chunk_gated_delta_rule, x)
    assert o.shape == (length, NUM_V_HEADS, D_V) and s.shape == (NUM_V_HEADS, D_K, D_V)
    torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-5)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=1e-5)


def test_recurrent_steps_match_the_reference_recurrent_form() -> None:
    x = _inputs(20, seed=7)
    q, k, v, g, beta = _ours(x)
    state = x["state"][None]
    outputs = []
    for t in range(20):  # one sequence, batch of 1, step by step
        o, state = recurrent_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        outputs.append(o[0])
    ref_o, ref_s = _reference(torch_recurrent_gated_delta_rule, x)
    torch.testing.assert_close(torch.stack(outputs), ref_o, rtol=0, atol=1e-5)
    torch.testing.assert_close(state[0], ref_s, rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [64, 16, 7])
def test_chunked_and_recurrent_forms_agree(chunk_size: int) -> None:
    """Chunks of any size and the step loop: the same outputs and final state within 1e-5; batched steps too."""
    xs = [_inputs(90, seed=100 + i) for i in range(3)]
    ours = [_ours(x) for x in xs]
    chunked_results = [chunked(*o, x["state"], chunk_size=chunk_size) for o, x in zip(ours, xs)]
    state = torch.stack([x["state"] for x in xs])  # (3, H, d_k, d_v): three sequences stepped together
    outputs = []
    for t in range(90):
        o, state = recurrent_step(*(torch.stack([seq[i][t] for seq in ours]) for i in range(5)), state)
        outputs.append(o)
    stepped = torch.stack(outputs, dim=1)  # (3, L, H, d_v)
    for i, (o, s) in enumerate(chunked_results):
        torch.testing.assert_close(o, stepped[i], rtol=0, atol=1e-5)
        torch.testing.assert_close(s, state[i], rtol=0, atol=1e-5)
    assert stepped.abs().max() > 0.1  # the outputs are not vanishing


def test_a_state_carried_across_calls_equals_one_call() -> None:
    """Prefill in pieces (the state handed from one call to the next) gives the one-call result."""
    x = _inputs(100, seed=3)
    q, k, v, g, beta = _ours(x)
    whole_o, whole_s = chunked(q, k, v, g, beta, x["state"])
    state, pieces = x["state"], []
    for start, end in ((0, 37), (37, 38), (38, 100)):
        o, state = chunked(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], state)
        pieces.append(o)
    torch.testing.assert_close(torch.cat(pieces), whole_o, rtol=0, atol=1e-5)
    torch.testing.assert_close(state, whole_s, rtol=0, atol=1e-5)
