"""RoPE inverse frequencies equal ``transformers``' own, bit for bit, for every supported type.

Positions run past the original context (``original_max_position_embeddings`` or
``max_position_embeddings``), where the scaled types differ from plain RoPE.
"""

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
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024,
                              "attention_factor": 1.25},
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

    positions = torch.tensor([0, 1, 7, 300, 1500, 2047, 6000])
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


@pytest.mark.parametrize(("prompt_len", "decode_positions"), [(100, [100, 101, 180]), (40, [63, 64, 65, 127])])
def test_dynamic_ntk_matches_transformers_forward_by_forward(prompt_len: int, decode_positions: list[int]) -> None:
    """One sequence as ``generate`` runs it: the prompt in one forward, then one token per forward.

    ``transformers`` rescales from the largest position of each forward (keeping the largest
    seen); ours from ``max(prompt length, position + 1)`` per row, which must agree forward by forward.
    """
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                            rope_scaling={"rope_type": "dynamic", "factor": 2.0}, architectures=["LlamaForCausalLM"])
    hf_rope = LlamaRotaryEmbedding(hf_config)
    config = ModelConfig.from_dict(hf_config.to_dict())
    assert config.max_model_len == 128
    rope = RotaryEmbedding(64, config.rope_theta, config.rope_scaling, torch.device("cpu"))
    x = torch.zeros(1, 1, 64)
    for forward in [list(range(prompt_len))] + [[p] for p in decode_positions]:
        positions = torch.tensor(forward)
        hf_cos, hf_sin = hf_rope(x, positions[None])  # (1, T, d)
        seq_lens = torch.tensor([max(prompt_len, p + 1) for p in forward])
        cos, sin = rope(positions, torch.float32, seq_lens)  # (T, 1, d)
        torch.testing.assert_close(cos[:, 0], hf_cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[:, 0], hf_sin[0], rtol=0, atol=1e-6)
    plain_cos, _ = RotaryEmbedding(64, 10000.0, None, torch.device("cpu"))(positions, torch.float32)
    assert not torch.allclose(cos, plain_cos)  # past 64 the rescaled rotation differs


def test_step_inputs_carry_each_rows_dynamic_length() -> None:
    """``max(prompt length, position + 1)`` per row, in the step's row order (decodes first)."""
    from tpserve.step import SamplingParams, ScheduledChunk
    from worker.step_inputs import build_step_inputs

    chunks = [ScheduledChunk(0, (1, 2, 3), 0), ScheduledChunk(1, (4,), 70, sample=True)]
    inputs = build_step_inputs(chunks, [[0], [1] * 18], [SamplingParams()] * 2, 4, torch.device("cpu"),
                               num_prompt_tokens=[5, 50])
    assert inputs.attn.positions.tolist() == [70, 0, 1, 2]
    assert inputs.attn.rope_seq_lens.tolist() == [71, 5, 5, 5]


def test_scaled_rope_extends_the_model_length() -> None:
    from tpserve.model_config import ModelConfig as Config

    base = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 4096}
    assert Config.from_dict(base).max_model_len == 4096
    yarn = Config.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 2048}})
    assert yarn.max_model_len == 8192 and yarn.rope_scaling["beta_fast"] == 32.0
    dynamic = Config.from_dict({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    assert dynamic.max_model_len == 8192
