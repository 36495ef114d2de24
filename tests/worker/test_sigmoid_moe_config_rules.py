"""The config keys of the sigmoid-routed MoE families (GLM-4.5, MiniMax-M2, Ernie 4.5) and of partial RoPE
are refused at parse time when impossible, one line naming the field (tpserve/model_config_rules.py).
"""

from __future__ import annotations

import pytest

from tpserve.model_config import ModelConfig


def _config(architecture: str, **overrides: object) -> dict:
    raw = {
        "architectures": [architecture], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 172,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
    }
    raw.update(overrides)
    return {k: v for k, v in raw.items() if v is not None}


GLM, MINIMAX, ERNIE = "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM", "Ernie4_5_MoeForCausalLM"
BAD = [
    ("topk_group-above-n_group", GLM, {"topk_group": 5}, "topk_group=5, n_group=4: topk_group must be at most n_group"),
    ("top_k-above-experts", GLM, {"num_experts_per_tok": 17, "topk_group": 4},
     "num_experts_per_tok=17, n_routed_experts=16: num_experts_per_tok must be at most n_routed_experts"),
    ("experts-not-divisible", GLM, {"n_group": 3, "topk_group": 3},
     "n_routed_experts=16, n_group=3: n_routed_experts must be divisible by n_group"),
    ("one-expert-per-group", GLM, {"n_group": 16, "topk_group": 4},
     "n_routed_experts=16, n_group=16: n_routed_experts / n_group must be >= 2"),
    ("top_k-above-kept-groups", GLM, {"num_experts_per_tok": 9},
     "num_experts_per_tok must be at most topk_group * n_routed_experts / n_group"),
    ("n_group-0", GLM, {"n_group": 0}, "n_group=0 must be a positive integer"),
    ("scaling-0", GLM, {"routed_scaling_factor": 0}, "routed_scaling_factor=0 must be a finite number > 0"),
    ("shared-negative", GLM, {"n_shared_experts": -1}, "n_shared_experts=-1 must be an integer >= 0"),
    ("dense-negative", GLM, {"first_k_dense_replace": -1}, "first_k_dense_replace=-1 must be an integer >= 0"),
    ("partial-0", GLM, {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0}},
     "rope_parameters.partial_rotary_factor=0 must be a number in (0, 1]"),
    ("partial-above-1", GLM, {"partial_rotary_factor": 1.5}, "partial_rotary_factor=1.5 must be a number in (0, 1]"),
    ("partial-odd-dim", GLM, {"partial_rotary_factor": 0.1875}, "gives rotary_dim=3 of head_dim=16"),
    ("partial-elsewhere", "LlamaForCausalLM", {"partial_rotary_factor": 0.5},
     "partial_rotary_factor=0.5 is not supported by LlamaForCausalLM"),
    ("minimax-rotary-odd", MINIMAX, {"num_local_experts": 8, "rotary_dim": 7}, "rotary_dim=7 must be a positive even"),
    ("minimax-rotary-wide", MINIMAX, {"num_local_experts": 8, "rotary_dim": 32},
     "rotary_dim=32, head_dim=16: rotary_dim must be at most head_dim"),
    ("minimax-top_k", MINIMAX, {"num_local_experts": 2, "num_experts_per_tok": 4},
     "num_experts_per_tok must be at most num_local_experts"),
    ("ernie-moe_k", ERNIE, {"moe_num_experts": 4, "moe_k": 6}, "moe_k=6, moe_num_experts=4: moe_k must be at most"),
    ("ernie-interval-0", ERNIE, {"moe_layer_interval": 0}, "moe_layer_interval=0 must be a positive integer"),
    ("ernie-norm-min-0", ERNIE, {"moe_norm_min": 0}, "moe_norm_min=0 must be a finite number > 0"),
    ("ernie-use_bias", ERNIE, {"use_bias": True}, "use_bias=true must be false (biased Ernie 4.5 projections"),
]


@pytest.mark.parametrize(("architecture", "overrides", "message"), [case[1:] for case in BAD],
                         ids=[case[0] for case in BAD])
def test_impossible_values_are_refused_naming_the_field(architecture: str, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        ModelConfig.from_dict(_config(architecture, **overrides))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_partial_rotary_dims() -> None:
    """GLM defaults to half the head; an explicit factor or MiniMax's ``rotary_dim`` sets it; 1 means whole heads."""
    assert ModelConfig.from_dict(_config(GLM)).rotary_dim == 8
    assert ModelConfig.from_dict(_config(GLM, partial_rotary_factor=0.25)).rotary_dim == 4
    assert ModelConfig.from_dict(_config(GLM, partial_rotary_factor=1.0)).rotary_dim is None
    assert ModelConfig.from_dict(_config(MINIMAX, num_local_experts=8, rotary_dim=8)).rotary_dim == 8
    assert ModelConfig.from_dict(_config(MINIMAX, num_local_experts=8)).rotary_dim is None
    assert ModelConfig.from_dict(_config("LlamaForCausalLM")).rotary_dim is None
