"""StarCoder2 at tensor-parallel degrees 1, 2 and 4 against ``transformers``.

A tiny seeded ``starcoder2`` checkpoint: LayerNorms with a bias (``norm_epsilon``), the
tanh-GELU MLP ``c_proj(gelu(c_fc(x)))`` and every projection with a bias (``use_bias``),
tied embeddings, and an 8-token ``sliding_window`` on every layer over 4-token blocks
(prompts and generations far past it; chunked prefill split on its edge). Head size 32
puts decodes on the compiled CPU attention kernel. The scenario of tests/worker/family_check.py.
"""

from __future__ import annotations

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.family_check import case, check, register

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

WINDOW = 8
STARCODER2 = register(TinyModelSpec("starcoder2", "starcoder2", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 190,
    "sliding_window": WINDOW, "use_bias": True, "norm_epsilon": 1e-5, "hidden_act": "gelu_pytorch_tanh",
}, seed=43), WINDOW)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_starcoder2_matches_transformers(tp: int) -> None:
    check(STARCODER2, tp)


def test_starcoder2_layers_slide_and_carry_biases() -> None:
    """Guards the test: every layer slides; norms and projections have biases (a meta-device model)."""
    import torch

    from tpserve.model_config import ModelConfig
    from worker.models.starcoder2 import Starcoder2ForCausalLM
    from worker.parallel_state import ParallelContext

    config = ModelConfig.from_pretrained(case(STARCODER2).jobs[0].model_dir)
    model = Starcoder2ForCausalLM(config, ParallelContext.single("meta"), torch.float32, tie_word_embeddings=True)
    layer = model.model.layers[1]
    assert [lay.self_attn.attn.sliding_window for lay in model.model.layers] == [WINDOW, WINDOW]
    assert layer.input_layernorm.bias is not None and model.model.norm.bias is not None
    assert layer.mlp.c_fc.bias is not None and layer.self_attn.o_proj.bias is not None
    assert layer.mlp.approximate == "tanh"


def test_starcoder2_without_hidden_act_is_tanh_gelu() -> None:
    """A config.json without ``hidden_act`` means Starcoder2Config's default (tanh GELU), not Llama's SiLU."""
    import torch

    from tpserve.model_config import ModelConfig
    from worker.models.starcoder2 import Starcoder2ForCausalLM
    from worker.parallel_state import ParallelContext

    raw = {**ModelConfig.from_pretrained(case(STARCODER2).jobs[0].model_dir).hf_config}
    del raw["hidden_act"]
    model = Starcoder2ForCausalLM(ModelConfig.from_dict(raw), ParallelContext.single("meta"), torch.float32,
                                  tie_word_embeddings=True)
    assert model.model.layers[0].mlp.approximate == "tanh"
    with pytest.raises(ValueError, match='config.json hidden_act="silu" must be "gelu_pytorch_tanh" or "gelu"'):
        ModelConfig.from_dict({**raw, "hidden_act": "silu"})  # refused before any rank starts
