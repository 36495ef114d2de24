"""Granite 4 hybrid's and Nemotron-H's config.json keys: nonsense refused at parse time, one line naming it.

tpserve/model_config_rules.py (the Mamba-2 sizes, the families' activations and MoE keys) and
tpserve/hybrid_layers.py (the layer lists) refuse what ``transformers`` would fail on or serve as
garbage; the edge values that make sense (an infinite time-step limit, however it is spelled) parse.
"""

from __future__ import annotations

import pytest

from tpserve.model_config import ModelConfig

INF = float("inf")


def _granite(**overrides: object) -> dict:
    raw = {"architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 190, "hidden_size": 64,
           "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 96, "layer_types": ["mamba", "attention", "mamba"], "mamba_n_heads": 8,
           "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_expand": 2, "mamba_d_conv": 4, "num_local_experts": 4,
           "num_experts_per_tok": 2}
    raw.update(overrides)
    return raw


def _nemotron(**overrides: object) -> dict:
    raw = {"architectures": ["NemotronHForCausalLM"], "vocab_size": 190, "hidden_size": 64, "intermediate_size": 96,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 96,
           "hybrid_override_pattern": "M*-ME", "num_hidden_layers": 5, "mamba_num_heads": 8, "mamba_head_dim": 16,
           "n_groups": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "mlp_hidden_act": "relu2"}
    raw.update(overrides)
    return raw


@pytest.mark.parametrize(("raw", "message"), [
    (_granite(mamba_n_groups=3), "mamba_n_heads=8, mamba_n_groups=3: mamba_n_heads must be a multiple"),
    (_granite(mamba_d_head=10), "mamba_n_heads * mamba_d_head must equal mamba_expand * hidden_size"),
    (_granite(mamba_d_conv=1), "mamba_d_conv=1 must be an integer >= 2"),
    (_granite(mamba_d_state=0), "mamba_d_state=0 must be a positive integer"),
    (_granite(mamba_d_head="wide"), 'mamba_d_head="wide" must be a positive integer or "auto"'),
    (_granite(time_step_limit=[0.5, 0.1]), "time_step_limit=[0.5, 0.1] must be [min, max] with 0 <= min <= max"),
    (_granite(position_embedding_type="alibi"), 'position_embedding_type="alibi" must be "rope" or "nope"'),
    (_granite(residual_multiplier=0), "residual_multiplier=0 must be a finite number > 0"),
    (_granite(layer_types=["mamba", "attention", "conv"]), "layer_types ['conv'] are not supported"),
    (_nemotron(n_groups=3), "mamba_num_heads=8, n_groups=3: mamba_num_heads must be a multiple"),
    (_nemotron(mlp_hidden_act="gelu"), 'mlp_hidden_act="gelu" must be "relu2"'),
    (_nemotron(mamba_hidden_act="relu"), 'mamba_hidden_act="relu" must be "silu"'),
    (_nemotron(moe_latent_size=32), "moe_latent_size=32 must be null (the latent MoE projection is not supported)"),
    (_nemotron(conv_kernel=0), "conv_kernel=0 must be an integer >= 2"),
    (_nemotron(num_experts_per_tok=5), "num_experts_per_tok must be at most n_routed_experts"),
    (_nemotron(hybrid_override_pattern="M*X"), "hybrid_override_pattern='M*X' must be a non-empty string"),
], ids=lambda case: case if isinstance(case, str) else None)
def test_nonsense_is_refused_naming_the_field(raw: dict, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_dict(raw)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("raw", [
    _granite(time_step_limit=[0.0, INF]),  # the Hub's JSON Infinity
    _granite(time_step_limit=[0.0, {"__float__": "Infinity"}]),  # transformers 5's tag
    _granite(time_step_limit=[0.001, 0.1], position_embedding_type=None, mamba_d_head="auto", num_local_experts=0),
    _nemotron(time_step_limit=[0.0, {"__float__": "Infinity"}], moe_latent_size=None),
    _nemotron(num_hidden_layers=None, layers_block_type=["linear_attention", "full_attention"]),
])
def test_sensible_values_parse(raw: dict) -> None:
    config = ModelConfig.from_dict({k: v for k, v in raw.items() if v is not None})
    assert config.state_layer_indices and config.layer_types[config.state_layer_indices[0]] == "linear_attention"


def test_the_spec_reads_the_limits_either_way() -> None:
    from worker.layers.mamba2 import mamba2_time_step_limit

    assert mamba2_time_step_limit([0.0, {"__float__": "Infinity"}]) == (0.0, INF)
    assert mamba2_time_step_limit([0.001, 0.1]) == (0.001, 0.1)
    assert mamba2_time_step_limit(None) == (0.0, INF)
