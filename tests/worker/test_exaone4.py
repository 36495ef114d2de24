"""EXAONE 4 at tensor-parallel degrees 1, 2 and 4 against ``transformers``.

A tiny seeded ``exaone4`` checkpoint: four layers, three local (RoPE, a 12-token window) to
one global without RoPE (``sliding_window_pattern`` 4: "global NoPE"); per-head QK norm with
random weights; post-norms; head_dim 32; 2 KV heads, replicated at degree 4. Prompts and
generations run past the window, through the scenario of tests/worker/family_check.py.
"""

from __future__ import annotations

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.family_check import case, check, register

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

WINDOW = 12
EXAONE4 = register(TinyModelSpec("exaone4", "exaone4", {
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 190,
    "sliding_window": WINDOW, "sliding_window_pattern": 4,
}, seed=44), WINDOW)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_exaone4_matches_transformers(tp: int) -> None:
    check(EXAONE4, tp)


def test_exaone4_local_and_global_layers() -> None:
    """Guards the test and the defaults: local layers rotate and slide, the global one does neither; a
    pattern string and a model without a window (every layer global, every layer rotating)."""
    import torch

    from tpserve.model_config import ModelConfig
    from worker.models.exaone4 import Exaone4ForCausalLM, exaone4_layer_types
    from worker.parallel_state import ParallelContext

    config = ModelConfig.from_pretrained(case(EXAONE4).jobs[0].model_dir)
    model = Exaone4ForCausalLM(config, ParallelContext.single("meta"), torch.float32, tie_word_embeddings=False)
    assert [layer.self_attn.use_rope for layer in model.model.layers] == [True] * 3 + [False]
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [WINDOW] * 3 + [None]
    pattern = ModelConfig.from_dict({**config.hf_config, "layer_types": None, "sliding_window_pattern": "LG"})
    assert exaone4_layer_types(pattern) == ("sliding_attention", "full_attention") * 2
    no_window = ModelConfig.from_dict({**config.hf_config, "layer_types": None, "sliding_window": None})
    model = Exaone4ForCausalLM(no_window, ParallelContext.single("meta"), torch.float32, tie_word_embeddings=False)
    assert [(layer.self_attn.use_rope, layer.self_attn.attn.sliding_window) for layer in model.model.layers] == \
        [(True, None)] * 4
