"""Llama with YaRN and with dynamic NTK RoPE at tensor-parallel degrees 1, 2 and 4 against ``transformers``.

Tiny checkpoints whose original context is shorter than the scenario's sequences
(tests/worker/family_check.py: prompts up to 40 tokens, 32 generated), so every
scaled rotation is exercised: YaRN with ``original_max_position_embeddings=16``;
dynamic NTK with ``max_position_embeddings=32`` (served to 128 positions, ``factor``
4), where each sequence's rotation depends on its prompt's length, through chunked
prefill, prefix-cache hits between identical prompts and recompute after preemption.
"""

from __future__ import annotations

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.family_check import case, check, register

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

YARN = register(TinyModelSpec("llama_yarn", "llama", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 140,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}, seed=51), None)
DYNAMIC = register(TinyModelSpec("llama_dynamic", "llama", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 140,
    "max_position_embeddings": 32, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, seed=52), None)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", [YARN, DYNAMIC])
def test_scaled_rope_model_matches_transformers(name: str, tp: int) -> None:
    check(name, tp)


def test_the_sequences_pass_the_original_context() -> None:
    """Guards the test: the longest prompt alone passes both original contexts."""
    from tpserve.model_config import ModelConfig

    dynamic = ModelConfig.from_pretrained(case(DYNAMIC).jobs[0].model_dir)
    assert dynamic.max_position_embeddings == 32 and dynamic.max_model_len == 128
    assert max(len(p) for p in case(DYNAMIC).prompts.values()) > 32
