"""The layers the 2025 dense families share (worker/layers/nope.py, norm.py), checked on their own.

* a NoPE layer's ``position_and_cache(qkv, None, ...)`` caches the projected keys as they are (after
  the per-head QK norm where given) and returns the unrotated queries; given the step's RoPE it is
  ``rotate_and_cache``, bit for bit;
* ``Float32ScaledRMSNorm`` in bfloat16 is ``transformers``' ``Olmo2RMSNorm`` bit for bit (the weight
  multiplied in float32 before the cast), and in float32 Llama's ``RMSNorm``.

The full-width QK norm across ranks: tests/worker/test_olmo2.py; the layers inside their families
against ``transformers``: tests/worker/test_olmo2.py, test_olmo3.py, test_smollm3.py, test_exaone4.py.
"""

from __future__ import annotations

import torch

from worker.layers.nope import position_and_cache
from worker.layers.norm import Float32ScaledRMSNorm, RMSNorm
from worker.layers.rotary import RotaryEmbedding, rotate_and_cache

CPU = torch.device("cpu")


def _step(num_heads: int = 4, num_kv_heads: int = 2, d: int = 16, tokens: int = 5, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * d, generator=generator)
    caches = [torch.zeros(8, 4, num_kv_heads, d) for _ in range(2)]  # (blocks, block_size, KVH, d)
    slots = torch.tensor([3, 9, 10, 17, 30])
    return qkv, caches, slots


def test_a_nope_layer_caches_its_keys_unrotated() -> None:
    qkv, (k_cache, v_cache), slots = _step()
    q, k, v = position_and_cache(qkv.clone(), None, k_cache, v_cache, slots, 4, 2)
    want_q, want_k, want_v = qkv.view(5, 8, 16).split([4, 2, 2], dim=1)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, want_v)
    assert torch.equal(k_cache.view(-1, 2, 16)[slots], want_k)
    assert torch.equal(v_cache.view(-1, 2, 16)[slots], want_v)
    assert k_cache.view(-1, 2, 16)[[0, 1, 2]].abs().sum() == 0  # nothing written elsewhere


def test_a_nope_layer_applies_its_per_head_qk_norm() -> None:
    qkv, (k_cache, v_cache), slots = _step(seed=1)
    norms = [RMSNorm(16, 1e-6, dtype=torch.float32, device=CPU) for _ in range(2)]
    for i, norm in enumerate(norms):
        norm.weight.data = 1 + 0.3 * torch.randn(16, generator=torch.Generator().manual_seed(10 + i))
    q, k, _ = position_and_cache(qkv.clone(), None, k_cache, v_cache, slots, 4, 2, qk_norm=(norms[0], norms[1]))
    heads_q, heads_k, _ = qkv.view(5, 8, 16).split([4, 2, 2], dim=1)
    torch.testing.assert_close(q, norms[0](heads_q), atol=0, rtol=0)
    torch.testing.assert_close(k_cache.view(-1, 2, 16)[slots], norms[1](heads_k), atol=0, rtol=0)


def test_with_the_steps_rope_it_is_rotate_and_cache() -> None:
    qkv, (k_cache, v_cache), slots = _step(seed=2)
    rope = RotaryEmbedding(16, 10000.0, None, CPU)(torch.tensor([3, 9, 10, 17, 30]), torch.float32)
    other_k, other_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    got = position_and_cache(qkv.clone(), rope, k_cache, v_cache, slots, 4, 2)
    want = rotate_and_cache(qkv.clone(), *rope, other_k, other_v, slots, 4, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(k_cache, other_k) and torch.equal(v_cache, other_v)
    assert not torch.equal(got[1], qkv.view(5, 8, 16)[:, 4:6])  # rotated, unlike a NoPE layer's


def test_float32_scaled_rms_norm_rounds_as_olmo2() -> None:
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    generator = torch.Generator().manual_seed(3)
    weight = 1 + 0.3 * torch.randn(64, generator=generator)
    x = torch.randn(7, 64, generator=generator)
    ours = Float32ScaledRMSNorm(64, 1e-6, dtype=torch.bfloat16, device=CPU)
    ours.weight.data = weight.bfloat16()
    ref = Olmo2RMSNorm(64, 1e-6).bfloat16()
    with torch.no_grad():
        ref.weight.copy_(weight.bfloat16())
        assert torch.equal(ours(x.bfloat16()), ref(x.bfloat16()))
        llama = RMSNorm(64, 1e-6, dtype=torch.bfloat16, device=CPU)
        llama.weight.data = weight.bfloat16()
        assert not torch.equal(llama(x.bfloat16()), ref(x.bfloat16()))  # casting first rounds differently
        ours32 = Float32ScaledRMSNorm(64, 1e-6, dtype=torch.float32, device=CPU)
        ours32.weight.data = weight.bfloat16().float()  # the reference holds the bfloat16-rounded weight
        torch.testing.assert_close(ours32(x), ref.float()(x), atol=1e-6, rtol=1e-6)
