"""SmolLM3 at tensor-parallel degrees 1, 2 and 4 against ``transformers``.

A tiny seeded ``smollm3`` checkpoint: four layers, the fourth without RoPE (a NoPE layer,
``no_rope_layer_interval`` 4) and, with ``use_sliding_window``, attending over a 12-token
window (``SmolLM3Config``'s default ``layer_types``); biases on q/k/v/o and the MLP; tied
LM head (SmolLM3's default). Prompts and generations run past the window, through the
scenario of tests/worker/family_check.py.
"""

from __future__ import annotations

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.family_check import case, check, register

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

WINDOW = 12
SMOLLM3 = register(TinyModelSpec("smollm3", "smollm3", {
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 190,
    "use_sliding_window": True, "sliding_window": WINDOW, "attention_bias": True, "mlp_bias": True, "pad_token_id": 0,
}, seed=43), WINDOW)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_smollm3_matches_transformers(tp: int) -> None:
    check(SMOLLM3, tp)


def test_smollm3_nope_layers() -> None:
    """Guards the test and the defaults: layer 3 is NoPE and slides, the others rotate over everything;
    the same from a config without ``no_rope_layers`` and ``layer_types``."""
    import torch

    from tpserve.model_config import ModelConfig
    from worker.models.llama import LlamaAttention
    from worker.models.smollm3 import NoPEAttention, SmolLM3ForCausalLM, smollm3_layer_windows, smollm3_rope_layers
    from worker.parallel_state import ParallelContext

    config = ModelConfig.from_pretrained(case(SMOLLM3).jobs[0].model_dir)
    assert config.tie_word_embeddings
    model = SmolLM3ForCausalLM(config, ParallelContext.single("meta"), torch.float32, tie_word_embeddings=True)
    assert [type(layer.self_attn) for layer in model.model.layers] == [LlamaAttention] * 3 + [NoPEAttention]
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [None] * 3 + [WINDOW]
    older = ModelConfig.from_dict({**config.hf_config, "no_rope_layers": None, "layer_types": None,
                                   "no_rope_layer_interval": 2})
    assert smollm3_rope_layers(older) == (True, False, True, False)
    assert smollm3_layer_windows(older) == (None, WINDOW, None, WINDOW)
