"""The hybrid families' config.json (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): what is read, and what is refused at start-up.

Refusals are one line naming the field (tpserve/model_config_rules.py, ModelConfig.check_tensor_parallel).
"""

from __future__ import annotations

import pytest

from tpserve.model_config import ModelConfig


def _config(architecture: str = "Qwen3NextForCausalLM", **overrides: object) -> dict:
    raw = {
        "architectures": [architecture], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
    }
    raw.update(overrides)
    return {k: v for k, v in raw.items() if v is not None}


@pytest.mark.parametrize("architecture", ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"])
def test_layer_types_default_to_every_fourth_layer_full_and_rope_to_a_quarter(architecture: str) -> None:
    config = ModelConfig.from_dict(_config(architecture))
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",)
    assert config.rotary_dim == 4  # partial_rotary_factor 0.25 of head_dim 16 (the families' default)
    two = ModelConfig.from_dict(_config(architecture, full_attention_interval=2))
    assert two.layer_types == ("linear_attention", "full_attention") * 4
    listed = ["full_attention"] + ["linear_attention"] * 7
    assert ModelConfig.from_dict(_config(architecture, layer_types=listed)).layer_types == tuple(listed)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"linear_num_key_heads": 0}, "linear_num_key_heads=0 must be a positive integer"),
    ({"linear_num_value_heads": -4}, "linear_num_value_heads=-4 must be a positive integer"),
    ({"linear_key_head_dim": 0}, "linear_key_head_dim=0 must be a positive integer"),
    ({"linear_value_head_dim": 8.5}, "linear_value_head_dim=8.5 must be a positive integer"),
    ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim=0 must be a positive integer"),
    ({"full_attention_interval": 0}, "full_attention_interval=0 must be a positive integer"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads must be a multiple of linear_num_key_heads"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0 must be a positive integer"),
    ({"layer_types": ["linear_attention"] * 7 + ["mamba"]}, "layer_types ['mamba'] are not supported"),
])
def test_nonsense_is_refused_naming_the_field(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=None) as error:
        ModelConfig.from_dict(_config(**overrides))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_linear_attention_layers_are_refused_for_a_family_without_them() -> None:
    with pytest.raises(ValueError, match="layer_types \\['linear_attention'\\] are not supported"):
        ModelConfig.from_dict(_config("Qwen3ForCausalLM", layer_types=["linear_attention"] * 8))


@pytest.mark.parametrize(("overrides", "tp", "message"), [
    ({}, 4, "linear_num_key_heads=2 is not divisible by tensor_parallel_size=4"),
    ({"linear_num_key_heads": 4, "linear_num_value_heads": 8}, 8,
     "linear_num_key_heads=4 is not divisible by tensor_parallel_size=8"),
])
def test_delta_net_heads_must_split_across_ranks(overrides: dict, tp: int, message: str) -> None:
    config = ModelConfig.from_dict(_config(**{"num_key_value_heads": 8, "num_attention_heads": 8,
                                              "intermediate_size": 256, **overrides}))
    with pytest.raises(ValueError) as error:
        config.check_tensor_parallel(tp)
    assert str(error.value) == message
    config.check_tensor_parallel(2)  # 2 key heads, 4 value heads: one key head a rank


@pytest.mark.parametrize(("architecture", "overrides", "named"), [
    ("Qwen3NextForCausalLM", {"layer_types": ["linear_attention"] * 8}, "layer_types"),
    ("NemotronHForCausalLM", {"hybrid_override_pattern": "M-ME", "num_hidden_layers": 4}, "hybrid_override_pattern"),
    ("GraniteMoeHybridForCausalLM", {"layer_types": ["mamba"] * 8}, "layer_types"),  # transformers' default config
])
def test_a_model_without_attention_layers_is_refused_naming_the_key(architecture: str, overrides: dict,
                                                                     named: str) -> None:
    """The cache is sized in KV bytes per block, none without attention: such a model failed in its ranks with a
    bare ZeroDivisionError (Granite 4's default config, a Nemotron-H pattern without '*')."""
    with pytest.raises(ValueError, match=f"config.json {named} has no attention layer"):
        ModelConfig.from_dict(_config(architecture, **overrides))
    mixed = {"layer_types": ["mamba"] * 7 + ["attention"]} if architecture.startswith("Granite") else \
        {"hybrid_override_pattern": "M*ME", "num_hidden_layers": 4} if architecture.startswith("Nemotron") else \
        {"layer_types": ["linear_attention"] * 7 + ["full_attention"]}
    assert ModelConfig.from_dict(_config(architecture, **mixed)).num_attention_layers == 1
