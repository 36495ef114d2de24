"""OLMo 3 at tensor-parallel degrees 1, 2 and 4 against ``transformers``.

A tiny seeded ``olmo3`` checkpoint: four layers, three sliding (a 12-token window) to one
full (``layer_types``), each type its own RoPE (sliding: base 10,000; full: base 500,000 with
linear scaling), and OLMo 2's post-norms and full-width QK norm; 2 KV heads, replicated at
degree 4. Prompts and generations run past the window, through the scenario of
tests/worker/family_check.py.
"""

from __future__ import annotations

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.family_check import case, check, register

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

WINDOW = 12
OLMO3 = register(TinyModelSpec("olmo3", "olmo3", {
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 190,
    "sliding_window": WINDOW,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}},
}, seed=42), WINDOW)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_olmo3_matches_transformers(tp: int) -> None:
    check(OLMO3, tp)


def test_olmo3_layers_and_ropes() -> None:
    """Guards the test and the defaults: 3 sliding : 1 full with two RoPEs; a flat ``rope_scaling`` on the full
    layers only; every fourth layer full without ``layer_types``."""
    import torch

    from tpserve.model_config import ModelConfig
    from worker.models.olmo3 import Olmo3ForCausalLM, olmo3_layer_types
    from worker.parallel_state import ParallelContext

    config = ModelConfig.from_pretrained(case(OLMO3).jobs[0].model_dir)
    model = Olmo3ForCausalLM(config, ParallelContext.single("meta"), torch.float32, tie_word_embeddings=False)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [WINDOW] * 3 + [None]
    assert model.model.rope_of_layer[:3] == [model.model.rope_of_layer[0]] * 3
    full = model.model.rotary_embs[model.model.rope_of_layer[3]]
    assert (full.theta, full.rope_scaling) == (500000.0, {"rope_type": "linear", "factor": 2.0})
    # transformers 4's flat keys: Olmo3Config puts rope_scaling on the full-attention layers only.
    flat = ModelConfig.from_dict({**config.hf_config, "rope_parameters": None, "rope_theta": 500000.0,
                                  "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert model.ropes(flat) == {"full_attention": (500000.0, {"rope_type": "linear", "factor": 2.0}),
                                 "sliding_attention": (500000.0, None)}
    older = ModelConfig.from_dict({**config.hf_config, "layer_types": None, "num_hidden_layers": 8})
    assert olmo3_layer_types(older) == ("sliding_attention",) * 3 + ("full_attention",) + \
        ("sliding_attention",) * 3 + ("full_attention",)
