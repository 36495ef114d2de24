"""Llama 4 text at tensor-parallel degrees 1, 2 and 4 against ``transformers``.

A tiny seeded ``llama4_text`` checkpoint with every Llama 4 mechanism on: four layers, the
first three RoPE layers with chunked local attention (``attention_chunk_size`` 8, over
4-token blocks: prompts and generations span up to nine chunks) and QK L2 norm, the fourth
a NoPE layer over the whole context with attention temperature tuning (``floor_scale`` 4,
``attn_scale`` 0.5, so the scale grows within the test's lengths); MoE on layers 1 and 3
(``interleave_moe_layer_step`` 2: 4 experts stored fused, top-1 sigmoid routing scaling the
experts' input, a shared expert), dense SwiGLU (``intermediate_size_mlp``) on 0 and 2;
llama3 RoPE scaling on interleaved pairs. The scenario of tests/worker/family_check.py
(prefill chunks of 8 tokens: boundaries on the attention chunks' edges; prefix-cache hits,
preemption, prompt logprobs); head size 32, so the NoPE layer's decodes take the compiled
CPU kernel while the chunked layers take theirs through the chunked path.
"""

from __future__ import annotations

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.family_check import case, check, register

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

CHUNK = 8
LLAMA4 = register(TinyModelSpec("llama4", "llama4_text", {
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 190,
    "intermediate_size": 64, "intermediate_size_mlp": 128, "num_local_experts": 4, "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 2, "attention_chunk_size": CHUNK, "use_qk_norm": True,
    "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.5, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "pad_token_id": 0,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
}, seed=44), CHUNK)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama4_matches_transformers(tp: int) -> None:
    check(LLAMA4, tp)


def test_llama4_layers() -> None:
    """Guards the test: 3 chunked RoPE layers and 1 NoPE layer; MoE on 1 and 3 (a meta-device model)."""
    import torch

    from tpserve.model_config import ModelConfig
    from worker.models.llama4 import Llama4ForCausalLM, Llama4MoE
    from worker.parallel_state import ParallelContext

    config = ModelConfig.from_pretrained(case(LLAMA4).jobs[0].model_dir)
    model = Llama4ForCausalLM(config, ParallelContext.single("meta"), torch.float32, tie_word_embeddings=False)
    attention = [layer.self_attn for layer in model.model.layers]
    assert [a.attn.attention_chunk_size for a in attention] == [CHUNK, CHUNK, CHUNK, None]
    assert [a.use_rope for a in attention] == [True, True, True, False]
    assert [a.qk_norm_eps is not None for a in attention] == [True, True, True, False]
    assert [a.temperature_tuning for a in attention] == [False, False, False, True]
    assert [isinstance(layer.feed_forward, Llama4MoE) for layer in model.model.layers] == [False, True, False, True]
