"""RoPE inverse frequencies equal ``transformers``' own, bit for bit, for every supported type."""

from __future__ import annotations

import pytest
import torch

from tpserve.model_config import ModelConfig
from worker.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq

ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("case", ROPE_CASES)
def test_inv_freq_matches_transformers(case: str) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = ROPE_CASES[case]
    hf_config = LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=2048,
                            rope_theta=500000.0, rope_scaling=dict(scaling) if scaling else None)
    hf_rope = LlamaRotaryEmbedding(hf_config)
    config = ModelConfig.from_dict({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    ours = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert torch.equal(ours, hf_rope.inv_freq)

    positions = torch.tensor([0, 1, 7, 300, 2047])
    x = torch.randn(1, len(positions), 128)  # (B, T, d) as transformers takes it
    hf_cos, hf_sin = hf_rope(x, positions[None])  # (1, T, d)
    cos, sin = RotaryEmbedding(128, config.rope_theta, config.rope_scaling, torch.device("cpu"))(positions, x.dtype)
    assert torch.equal(cos[:, 0], hf_cos[0]) and torch.equal(sin[:, 0], hf_sin[0])


def test_apply_rotary_matches_transformers() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rope = RotaryEmbedding(16, 10000.0, None, torch.device("cpu"))
    positions = torch.tensor([3, 4, 5])
    cos, sin = rope(positions, torch.float32)  # (T, 1, d)
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)  # (T, heads, d)
    # transformers: q (B, heads, T, d), cos (B, T, d) unsqueezed at dim 1.
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[:, 0][None], sin[:, 0][None]
    )
    torch.testing.assert_close(apply_rotary(q, cos, sin), hf_q[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(apply_rotary(k, cos, sin), hf_k[0].transpose(0, 1), rtol=0, atol=0)
