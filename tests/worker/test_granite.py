"""IBM Granite 3 at tensor-parallel degrees 1, 2 and 4 against ``transformers``.

A tiny seeded ``granite`` checkpoint whose four multipliers are all far from 1 (and the
softmax scale far from ``head_dim ** -0.5``), so that a missing or misplaced one changes
the tokens: embeddings x 6, residual branches x 0.5, attention scale 0.05 (not 32 ** -0.5
= 0.177), logits / 2.5; biases on q/k/v/o (``attention_bias``) and the MLP (``mlp_bias``).
It runs the scenario of tests/worker/family_check.py (alone and 16 at once, chunked
prefill, prefix-cache hits, preemption, prompt logprobs).
"""

from __future__ import annotations

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.family_check import case, check, register

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

GRANITE = register(TinyModelSpec("granite", "granite", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 190,
    "tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True,
    "embedding_multiplier": 6.0, "residual_multiplier": 0.5, "attention_multiplier": 0.05, "logits_scaling": 2.5,
}, seed=41), None)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_granite_matches_transformers(tp: int) -> None:
    check(GRANITE, tp)


def test_granite_reads_its_multipliers() -> None:
    """Guards the test: the checkpoint's multipliers reach the model (built on the meta device)."""
    import torch

    from tpserve.model_config import ModelConfig
    from worker.models.granite import GraniteForCausalLM
    from worker.parallel_state import ParallelContext

    config = ModelConfig.from_pretrained(case(GRANITE).jobs[0].model_dir)
    model = GraniteForCausalLM(config, ParallelContext.single("meta"), torch.float32, tie_word_embeddings=False)
    assert (model.embedding_multiplier, model.logits_scaling) == (6.0, 2.5)
    assert [layer.residual_multiplier for layer in model.model.layers] == [0.5, 0.5]
    assert [layer.self_attn.attn.scale for layer in model.model.layers] == [0.05, 0.05]
    assert model.model.decode_stack is None  # Llama's compiled decode stack adds the residual unscaled
