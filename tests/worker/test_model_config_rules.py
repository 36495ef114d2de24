"""Nonsense in config.json is refused at parse time, one line naming the field and its value.

Each case was served before (NaN or garbage for every request, every request refused, or
a traceback in a rank): tpserve/model_config_rules.py's tables now refuse it.
"""

from __future__ import annotations

import pytest

from tpserve.model_config import ModelConfig

NAN = float("nan")


def _config(architecture: str = "LlamaForCausalLM", **overrides: object) -> dict:
    raw = {
        "architectures": [architecture], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 172,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "gelu_pytorch_tanh" if architecture == "Starcoder2ForCausalLM" else "silu",
    }
    raw.update(overrides)
    return {k: v for k, v in raw.items() if v is not None}


def _rope(rope_type: str, **fields: object) -> dict:
    base = {"linear": {"factor": 2.0}, "dynamic": {"factor": 2.0}, "yarn": {"factor": 4.0},
            "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}}[rope_type]
    return {"rope_scaling": {"rope_type": rope_type, **base, **fields}}


# (case id, architecture, overrides, the refusal's text)
BAD_VALUES = [
    # RoPE: factors of each scaling type, their sub-fields, bases
    ("linear-factor-0", "LlamaForCausalLM", _rope("linear", factor=0), "rope_scaling.factor=0 must be a finite number > 0"),
    ("linear-factor-negative", "LlamaForCausalLM", _rope("linear", factor=-2.0), "rope_scaling.factor=-2.0 must be"),
    ("yarn-factor-0", "LlamaForCausalLM", _rope("yarn", factor=0.0), "rope_scaling.factor=0.0 must be a finite number > 0"),
    ("yarn-factor-negative", "Qwen2ForCausalLM", _rope("yarn", factor=-4), "rope_scaling.factor=-4 must be"),
    ("llama3-factor-0", "LlamaForCausalLM", _rope("llama3", factor=0), "rope_scaling.factor=0 must be"),
    ("llama3-factor-negative", "LlamaForCausalLM", _rope("llama3", factor=-8.0), "rope_scaling.factor=-8.0 must be"),
    ("dynamic-factor-0", "LlamaForCausalLM", _rope("dynamic", factor=0), "rope_scaling.factor=0 must be a finite number >= 1"),
    ("dynamic-factor-below-1", "LlamaForCausalLM", _rope("dynamic", factor=0.5), "rope_scaling.factor=0.5 must be a finite number >= 1"),
    ("factor-nan-string", "LlamaForCausalLM", _rope("linear", factor="nan"), 'rope_scaling.factor="nan" must be'),
    ("llama3-low-freq-0", "LlamaForCausalLM", _rope("llama3", low_freq_factor=0), "rope_scaling.low_freq_factor=0 must be"),
    ("llama3-high-equals-low", "LlamaForCausalLM", _rope("llama3", high_freq_factor=1.0),
     "rope_scaling.low_freq_factor=1.0, rope_scaling.high_freq_factor=1.0: high_freq_factor must be greater"),
    ("llama3-original-max-0", "LlamaForCausalLM", _rope("llama3", original_max_position_embeddings=0),
     "rope_scaling.original_max_position_embeddings=0 must be a positive integer"),
    ("yarn-beta-fast-0", "LlamaForCausalLM", _rope("yarn", beta_fast=0), "rope_scaling.beta_fast=0 must be"),
    ("yarn-beta-slow-negative", "LlamaForCausalLM", _rope("yarn", beta_slow=-1), "rope_scaling.beta_slow=-1 must be"),
    ("yarn-attention-factor-0", "LlamaForCausalLM", _rope("yarn", attention_factor=0), "rope_scaling.attention_factor=0 must be"),
    ("yarn-mscale-inf", "LlamaForCausalLM", _rope("yarn", mscale=float("inf")), "rope_scaling.mscale=Infinity must be a finite number"),
    ("rope-theta-0", "LlamaForCausalLM", {"rope_theta": 0}, "rope_theta=0 must be a finite number > 0"),
    ("rope-theta-negative", "LlamaForCausalLM", {"rope_theta": -10000.0}, "rope_theta=-10000.0 must be"),
    ("rope-theta-nan", "LlamaForCausalLM", {"rope_theta": NAN}, "rope_theta=NaN must be"),
    ("rope-theta-0-transformers5", "LlamaForCausalLM", {"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     "rope_parameters.rope_theta=0 must be"),
    ("rope-theta-0-by-layer-type", "Gemma3ForCausalLM",
     {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 0}}},
     "rope_parameters.sliding_attention.rope_theta=0 must be"),
    # norms' epsilon
    ("rms-norm-eps-negative", "LlamaForCausalLM", {"rms_norm_eps": -1e-5}, "rms_norm_eps=-1e-05 must be a finite number > 0"),
    ("rms-norm-eps-0", "LlamaForCausalLM", {"rms_norm_eps": 0}, "rms_norm_eps=0 must be"),
    ("rms-norm-eps-nan-string", "LlamaForCausalLM", {"rms_norm_eps": "nan"}, 'rms_norm_eps="nan" must be'),
    ("rms-norm-eps-nan", "LlamaForCausalLM", {"rms_norm_eps": NAN}, "rms_norm_eps=NaN must be"),
    ("rms-norm-eps-infinite", "LlamaForCausalLM", {"rms_norm_eps": float("inf")}, "rms_norm_eps=Infinity must be"),
    # positions, heads, sizes
    ("max-positions-0", "LlamaForCausalLM", {"max_position_embeddings": 0}, "max_position_embeddings=0 must be a positive integer"),
    ("max-positions-negative", "LlamaForCausalLM", {"max_position_embeddings": -512}, "max_position_embeddings=-512 must be"),
    ("max-positions-string", "LlamaForCausalLM", {"max_position_embeddings": "4096"}, 'max_position_embeddings="4096" must be'),
    ("heads-0", "LlamaForCausalLM", {"num_attention_heads": 0}, "num_attention_heads=0 must be a positive integer"),
    ("heads-true", "LlamaForCausalLM", {"num_attention_heads": True}, "num_attention_heads=true must be a positive integer"),
    ("kv-heads-0", "LlamaForCausalLM", {"num_key_value_heads": 0}, "num_key_value_heads=0 must be a positive integer"),
    ("heads-not-a-multiple-of-kv-heads", "LlamaForCausalLM", {"num_attention_heads": 6},
     "num_attention_heads=6, num_key_value_heads=4: num_attention_heads must be a multiple of num_key_value_heads"),
    ("head-dim-0", "LlamaForCausalLM", {"head_dim": 0}, "head_dim=0 must be a positive even integer"),
    ("head-dim-odd", "LlamaForCausalLM", {"head_dim": 7}, "head_dim=7 must be a positive even integer"),
    ("hidden-size-0", "LlamaForCausalLM", {"hidden_size": 0}, "hidden_size=0 must be a positive integer"),
    ("intermediate-size-negative", "LlamaForCausalLM", {"intermediate_size": -172}, "intermediate_size=-172 must be"),
    ("vocab-size-0", "LlamaForCausalLM", {"vocab_size": 0}, "vocab_size=0 must be a positive integer"),
    ("layers-float", "LlamaForCausalLM", {"num_hidden_layers": 4.0}, "num_hidden_layers=4.0 must be a positive integer"),
    ("sliding-window-negative", "MistralForCausalLM", {"sliding_window": -1}, "sliding_window=-1 must be a positive integer"),
    ("sliding-window-string", "MistralForCausalLM", {"sliding_window": "4096"}, 'sliding_window="4096" must be'),
    ("max-window-layers-negative", "Qwen2ForCausalLM", {"max_window_layers": -1}, "max_window_layers=-1 must be an integer >= 0"),
    # the families' own keys
    ("mixtral-experts-0", "MixtralForCausalLM", {"num_local_experts": 0}, "num_local_experts=0 must be a positive integer"),
    ("mixtral-more-per-token-than-experts", "MixtralForCausalLM", {"num_local_experts": 2, "num_experts_per_tok": 3},
     "num_experts_per_tok=3, num_local_experts=2: num_experts_per_tok must be at most num_local_experts"),
    ("qwen2moe-experts-per-token-0", "Qwen2MoeForCausalLM", {"num_experts_per_tok": 0}, "num_experts_per_tok=0 must be"),
    ("qwen2moe-sparse-step-0", "Qwen2MoeForCausalLM", {"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be"),
    ("qwen2moe-shared-expert-size-0", "Qwen2MoeForCausalLM", {"shared_expert_intermediate_size": 0},
     "shared_expert_intermediate_size=0 must be"),
    ("qwen3moe-moe-size-negative", "Qwen3MoeForCausalLM", {"moe_intermediate_size": -768}, "moe_intermediate_size=-768 must be"),
    ("qwen3moe-more-per-token-than-experts", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 8},
     "num_experts_per_tok must be at most num_experts"),
    ("gemma2-query-scalar-0", "Gemma2ForCausalLM", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar=0 must be"),
    ("gemma2-softcap-negative", "Gemma2ForCausalLM", {"final_logit_softcapping": -30.0}, "final_logit_softcapping=-30.0 must be"),
    ("gemma2-attn-softcap-0", "Gemma2ForCausalLM", {"attn_logit_softcapping": 0}, "attn_logit_softcapping=0 must be"),
    ("gemma3-local-base-0", "Gemma3ForCausalLM", {"rope_local_base_freq": 0}, "rope_local_base_freq=0 must be"),
    ("gemma3-window-pattern-0", "Gemma3ForCausalLM", {"sliding_window_pattern": 0}, "sliding_window_pattern=0 must be"),
    ("gpt-oss-swiglu-limit-0", "GptOssForCausalLM", {"swiglu_limit": 0}, "swiglu_limit=0 must be a finite number > 0"),
    ("gpt-oss-swiglu-limit-negative", "GptOssForCausalLM", {"swiglu_limit": -7.0}, "swiglu_limit=-7.0 must be"),
    ("gpt-oss-swiglu-alpha-nan", "GptOssForCausalLM", {"swiglu_alpha": NAN}, "swiglu_alpha=NaN must be"),
    ("gpt-oss-sliding-window-0", "GptOssForCausalLM", {"sliding_window": 0}, "sliding_window=0 must be a positive integer"),
    ("gpt-oss-experts-0", "GptOssForCausalLM", {"num_local_experts": 0}, "num_local_experts=0 must be a positive integer"),
    ("gpt-oss-more-per-token-than-experts", "GptOssForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 5},
     "num_experts_per_tok must be at most num_local_experts"),
    ("granite-logits-scaling-0", "GraniteForCausalLM", {"logits_scaling": 0}, "logits_scaling=0 must be a finite number > 0"),
    ("granite-logits-scaling-negative", "GraniteForCausalLM", {"logits_scaling": -8.0}, "logits_scaling=-8.0 must be"),
    ("granite-embedding-multiplier-nan", "GraniteForCausalLM", {"embedding_multiplier": NAN},
     "embedding_multiplier=NaN must be"),
    ("granite-residual-multiplier-0", "GraniteForCausalLM", {"residual_multiplier": 0}, "residual_multiplier=0 must be"),
    ("granite-attention-multiplier-string", "GraniteForCausalLM", {"attention_multiplier": "0.0078125"},
     'attention_multiplier="0.0078125" must be'),
    ("cohere-logit-scale-0", "CohereForCausalLM", {"logit_scale": 0}, "logit_scale=0 must be a finite number > 0"),
    ("cohere-layer-norm-eps-negative", "CohereForCausalLM", {"layer_norm_eps": -1e-5}, "layer_norm_eps=-1e-05 must be"),
    ("starcoder2-norm-epsilon-0", "Starcoder2ForCausalLM", {"norm_epsilon": 0}, "norm_epsilon=0 must be"),
    ("llama4-chunk-size-0", "Llama4ForCausalLM", {"attention_chunk_size": 0},
     "attention_chunk_size=0 must be a positive integer"),
    ("llama4-chunk-size-negative", "Llama4ForCausalLM", {"attention_chunk_size": -8192}, "attention_chunk_size=-8192 must be"),
    ("llama4-experts-per-token-0", "Llama4ForCausalLM", {"num_experts_per_tok": 0}, "num_experts_per_tok=0 must be"),
    ("llama4-more-per-token-than-experts", "Llama4ForCausalLM", {"num_local_experts": 2, "num_experts_per_tok": 3},
     "num_experts_per_tok must be at most num_local_experts"),
    ("llama4-moe-step-0", "Llama4ForCausalLM", {"interleave_moe_layer_step": 0}, "interleave_moe_layer_step=0 must be"),
    ("llama4-floor-scale-0", "Llama4ForCausalLM", {"floor_scale": 0}, "floor_scale=0 must be"),
    ("smollm3-no-rope-layers-short", "SmolLM3ForCausalLM", {"no_rope_layers": [1, 1, 0]},
     "no_rope_layers=[1, 1, 0] must list one value per layer (num_hidden_layers=4), each 0 (no RoPE) or 1 (RoPE)"),
    ("smollm3-no-rope-layers-value", "SmolLM3ForCausalLM", {"no_rope_layers": [1, 1, 2, 0]},
     "no_rope_layers=[1, 1, 2, 0] must list one value per layer"),
    ("smollm3-no-rope-layers-not-a-list", "SmolLM3ForCausalLM", {"no_rope_layers": 4}, "no_rope_layers=4 must list"),
    ("smollm3-no-rope-interval-0", "SmolLM3ForCausalLM", {"no_rope_layer_interval": 0},
     "no_rope_layer_interval=0 must be a positive integer"),
    ("smollm3-window-0", "SmolLM3ForCausalLM", {"use_sliding_window": True, "sliding_window": 0},
     "sliding_window=0 must be a positive integer"),
    ("olmo3-window-0", "Olmo3ForCausalLM", {"sliding_window": 0}, "sliding_window=0 must be a positive integer"),
    ("olmo3-window-negative", "Olmo3ForCausalLM", {"sliding_window": -4096}, "sliding_window=-4096 must be"),
    ("olmo2-eps-0", "Olmo2ForCausalLM", {"rms_norm_eps": 0}, "rms_norm_eps=0 must be"),
    ("exaone4-window-0", "Exaone4ForCausalLM", {"sliding_window": 0}, "sliding_window=0 must be a positive integer"),
    ("exaone4-pattern-0", "Exaone4ForCausalLM", {"sliding_window_pattern": 0},
     "sliding_window_pattern=0 must be a positive integer (every n-th layer global) or a string of 'L' (local)"),
    ("exaone4-pattern-letters", "Exaone4ForCausalLM", {"sliding_window_pattern": "LLLX"},
     'sliding_window_pattern="LLLX" must be'),
    # multi-head latent attention and DeepSeek V3's expert groups
    ("mla-kv-lora-rank-0", "DeepseekV3ForCausalLM", {"kv_lora_rank": 0}, "kv_lora_rank=0 must be a positive integer"),
    ("mla-kv-lora-rank-negative", "DeepseekV3ForCausalLM", {"kv_lora_rank": -512}, "kv_lora_rank=-512 must be"),
    ("mla-q-lora-rank-0", "DeepseekV3ForCausalLM", {"q_lora_rank": 0}, "q_lora_rank=0 must be a positive integer"),
    ("mla-rope-dim-odd", "DeepseekV3ForCausalLM", {"qk_rope_head_dim": 7},
     "qk_rope_head_dim=7 must be a positive even integer (RoPE rotates pairs)"),
    ("mla-nope-dim-0", "DeepseekV3ForCausalLM", {"qk_nope_head_dim": 0}, "qk_nope_head_dim=0 must be a positive integer"),
    ("mla-v-head-dim-float", "DeepseekV3ForCausalLM", {"v_head_dim": 128.0}, "v_head_dim=128.0 must be a positive"),
    ("dsv3-first-dense-negative", "DeepseekV3ForCausalLM", {"first_k_dense_replace": -1},
     "first_k_dense_replace=-1 must be an integer >= 0"),
    ("dsv3-topk-group-over-n-group", "DeepseekV3ForCausalLM", {"n_group": 4, "topk_group": 5, "n_routed_experts": 8},
     "n_group=4: topk_group must be at most n_group"),
    ("dsv3-experts-not-in-groups", "DeepseekV3ForCausalLM", {"n_group": 3, "topk_group": 1, "n_routed_experts": 8},
     "n_routed_experts=8, n_group=3: n_routed_experts must be divisible by n_group"),
    ("dsv3-top-k-over-experts", "DeepseekV3ForCausalLM",
     {"n_group": 1, "topk_group": 1, "n_routed_experts": 8, "num_experts_per_tok": 9},
     "num_experts_per_tok=9, n_routed_experts=8: num_experts_per_tok must be at most n_routed_experts"),
    ("dsv3-routed-scaling-0", "DeepseekV3ForCausalLM", {"routed_scaling_factor": 0}, "routed_scaling_factor=0 must be"),
    # DeepSeek V2's routers under V3's architecture name: served as V3's sigmoid router before (as transformers does)
    ("dsv3-softmax-scores", "DeepseekV3ForCausalLM", {"scoring_func": "softmax"},
     'scoring_func="softmax" must be "sigmoid"'),
    ("dsv3-greedy-top-k", "DeepseekV3ForCausalLM", {"topk_method": "greedy"}, 'topk_method="greedy" must be "noaux_tc"'),
    # the MLP's activation: refused by each rank as it built the model, after the ranks had started
    ("llama-gelu", "LlamaForCausalLM", {"hidden_act": "gelu"}, 'hidden_act="gelu" must be "silu"'),
    ("qwen3-moe-relu", "Qwen3MoeForCausalLM", {"hidden_act": "relu"}, 'hidden_act="relu" must be "silu"'),
    ("starcoder2-silu", "Starcoder2ForCausalLM", {"hidden_act": "silu"},
     'hidden_act="silu" must be "gelu_pytorch_tanh" or "gelu"'),
    ("gemma2-relu", "Gemma2ForCausalLM", {"hidden_activation": "relu"}, 'hidden_activation="relu" must be'),
]


@pytest.mark.parametrize(("architecture", "overrides", "message"), [case[1:] for case in BAD_VALUES],
                         ids=[case[0] for case in BAD_VALUES])
def test_nonsense_is_refused_naming_the_field_and_value(architecture: str, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        ModelConfig.from_dict(_config(architecture, **overrides))
    text = str(error.value)
    assert text.startswith("config.json ") and message in text, text
    assert "\n" not in text


@pytest.mark.parametrize(("architecture", "overrides"), [
    ("LlamaForCausalLM", _rope("dynamic", factor=1.0)),
    ("LlamaForCausalLM", _rope("linear", factor=0.5)),  # compresses positions: odd, not nonsense
    ("Qwen2MoeForCausalLM", {"num_experts": 0, "num_experts_per_tok": 4}),  # 0 experts: every layer dense
    ("Gemma2ForCausalLM", {"final_logit_softcapping": None}),  # null: no soft-capping
    ("Qwen2MoeForCausalLM", {"use_sliding_window": False, "sliding_window": 0}),  # switched off: not read
    ("Glm4MoeForCausalLM", {"sliding_window": 0}),  # a family that never reads the key (transformers ignores it)
    ("DeepseekV3ForCausalLM", {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}),  # V3's, as published
    ("LlamaForCausalLM", {"num_experts_per_tok": "x"}),  # a key Llama does not read is not checked
    ("SmolLM3ForCausalLM", {"no_rope_layers": [1, 1, 1, 0]}),
    ("SmolLM3ForCausalLM", {"no_rope_layers": [True, True, True, False]}),  # booleans are 1 and 0 to transformers
    ("Exaone4ForCausalLM", {"sliding_window": 128, "sliding_window_pattern": "LLLG"}),
    ("Exaone4ForCausalLM", {"sliding_window": 128, "sliding_window_pattern": 4}),
    # Latent attention has no key/value heads: DeepseekV3Config's default 128 is not a group of 8 query heads.
    ("DeepseekV3ForCausalLM", {"num_key_value_heads": 128, "q_lora_rank": None}),
    # Gemma's MLP reads hidden_activation; a hidden_act beside it (older GemmaConfig wrote one) is not read.
    ("Gemma2ForCausalLM", {"hidden_act": "gelu_new", "hidden_activation": "gelu_pytorch_tanh"}),
    ("Starcoder2ForCausalLM", {"hidden_act": "gelu"}),  # exact GELU
])
def test_edge_values_that_make_sense_are_served(architecture: str, overrides: dict) -> None:
    ModelConfig.from_dict(_config(architecture, **overrides))


def test_chunked_attention_layers_are_refused_where_the_family_does_not_chunk() -> None:
    """Llama 4 reads ``chunked_attention`` layer types; Llama would serve them as full attention, so it refuses."""
    chunked = {"layer_types": ["chunked_attention"] * 3 + ["full_attention"], "attention_chunk_size": 8192}
    assert ModelConfig.from_dict(_config("Llama4ForCausalLM", **chunked)).layer_types[0] == "chunked_attention"
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not supported"):
        ModelConfig.from_dict(_config("LlamaForCausalLM", **chunked))


def test_rope_theta_zero_is_not_replaced_by_the_default() -> None:
    """``rope_theta: 0`` used to become 10000 silently (an ``or`` chain); absent still means 10000."""
    assert ModelConfig.from_dict(_config(rope_theta=None)).rope_theta == 10000.0
    assert ModelConfig.from_dict(_config(rope_theta=500000)).rope_theta == 500000.0
    with pytest.raises(ValueError, match="rope_theta=0 must be"):
        ModelConfig.from_dict(_config(rope_theta=0))


def test_tie_word_embeddings_defaults_to_the_familys() -> None:
    """Absent from config.json: Gemma ties (its transformers config's default), the others do not."""
    assert ModelConfig.from_dict(_config("Gemma2ForCausalLM")).tie_word_embeddings is True
    assert ModelConfig.from_dict(_config("Gemma3ForCausalLM")).tie_word_embeddings is True
    assert ModelConfig.from_dict(_config("CohereForCausalLM")).tie_word_embeddings is True
    assert ModelConfig.from_dict(_config("Starcoder2ForCausalLM")).tie_word_embeddings is True
    assert ModelConfig.from_dict(_config("GraniteForCausalLM")).tie_word_embeddings is False
    assert ModelConfig.from_dict(_config("SmolLM3ForCausalLM")).tie_word_embeddings is True
    assert ModelConfig.from_dict(_config("Olmo3ForCausalLM")).tie_word_embeddings is False
    assert ModelConfig.from_dict(_config("LlamaForCausalLM")).tie_word_embeddings is False
    assert ModelConfig.from_dict(_config("Gemma2ForCausalLM", tie_word_embeddings=False)).tie_word_embeddings is False
    # Nemotron-H's model never ties (transformers' NemotronHForCausalLM: empty _tied_weights_keys), whatever the key
    # says: a config with true and its own lm_head.weight was served from the embedding, tokens off from the first.
    nemotron = _config("NemotronHForCausalLM", tie_word_embeddings=True, hybrid_override_pattern="M*M-",
                       hidden_act=None, mlp_hidden_act="relu2")
    assert ModelConfig.from_dict(nemotron).tie_word_embeddings is False
