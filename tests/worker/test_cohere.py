"""Cohere Command R at tensor-parallel degrees 1, 2 and 4 against ``transformers``.

A tiny seeded ``cohere`` checkpoint with what sets it apart from Llama: one LayerNorm
per layer feeding attention and MLP in parallel, interleaved RoPE, ``logit_scale`` (0.25),
tied embeddings, and the per-head q/k LayerNorms of ``use_qk_norm`` (Command R+), whose
``(heads, head_dim)`` weights are split by head (degree 4 replicates the 2 KV heads'
rows); biases on q/k/v/o (``attention_bias``). A second checkpoint is Command R as released:
no QK norm, no bias, the default ``logit_scale``, one KV head. The scenario of
tests/worker/family_check.py.
"""

from __future__ import annotations

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.family_check import case, check, register

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

COHERE = register(TinyModelSpec("cohere", "cohere", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 190, "pad_token_id": 0,
    "use_qk_norm": True, "attention_bias": True, "logit_scale": 0.25, "layer_norm_eps": 1e-5,
}, seed=42), None)
# Command R (v01) as released: no QK norm, no bias, the default logit_scale (1/16); one KV head (MQA), replicated.
COMMAND_R = register(TinyModelSpec("cohere_command_r", "cohere", {
    "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 170, "pad_token_id": 0,
}, seed=45), None)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", [COHERE, COMMAND_R])
def test_cohere_matches_transformers(name: str, tp: int) -> None:
    check(name, tp)


def test_interleaved_rope_is_cohere_s() -> None:
    """The interleaved rotation equals ``transformers``' Cohere ``apply_rotary_pos_emb``, not Llama's."""
    import torch
    from transformers.models.cohere import modeling_cohere

    from worker.layers.rotary import RotaryEmbedding, apply_rotary, apply_rotary_interleaved

    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(0))  # (T, heads, d)
    positions = torch.tensor([0, 1, 7, 30, 95])
    cos, sin = RotaryEmbedding(16, 10000.0, None, torch.device("cpu"), interleaved=True)(positions, torch.float32)
    want, _ = modeling_cohere.apply_rotary_pos_emb(x.transpose(0, 1), x.transpose(0, 1), cos[:, 0], sin[:, 0],
                                                   unsqueeze_dim=0)
    torch.testing.assert_close(apply_rotary_interleaved(x, cos, sin), want.transpose(0, 1))
    assert not torch.allclose(apply_rotary(x, cos, sin), want.transpose(0, 1), atol=1e-3)


def test_cohere_qk_norms_hold_their_heads() -> None:
    """Guards the test: q/k norms exist, split by head at degree 2 (a meta-device model per rank)."""
    import torch

    from tpserve.model_config import ModelConfig
    from worker.models.cohere import CohereForCausalLM
    from worker.parallel_state import ParallelContext

    config = ModelConfig.from_pretrained(case(COHERE).jobs[0].model_dir)
    model = CohereForCausalLM(config, ParallelContext.single("meta"), torch.float32, tie_word_embeddings=True)
    attention = model.model.layers[0].self_attn
    assert attention.q_norm.weight.shape == (4, 16) and attention.k_norm.weight.shape == (2, 16)
    assert model.logit_scale == 0.25 and model.model.rotary_emb.interleaved
