"""Which values of a ``config.json`` make sense: one table of rules, field -> what it must be.

A model served from nonsense (a RoPE factor of 0, a negative ``rms_norm_eps``, zero heads)
does not fail: it answers NaN or garbage for every request, or refuses every request, or
dies in a traceback deep in a rank. :func:`check_config` refuses it at start-up instead,
before any process starts, with one line naming the field and its value, e.g.
``config.json rope_theta=0 must be a finite number > 0``.

The tables, each ``field -> Check``, a field checked only where present (not null; a
missing required key is :func:`tpserve.model_config._required`'s error):

- :data:`MODEL_RULES`: the keys every family reads (sizes, heads, positions, epsilon, base);
- :data:`FAMILY_RULES`: the keys one architecture reads (experts, Gemma's and Granite's scalars,
  the LayerNorm epsilons of Cohere and StarCoder2);
- :data:`ROPE_RULES`: the keys of a ``rope_scaling`` / ``rope_parameters`` dict (each
  layer type's too); ``longrope`` and other types are refused by the parser, not here;
- :data:`RELATIONS`: rules between fields (heads by key/value heads, experts per token);
  :data:`FAMILY_RELATIONS`: one architecture's (expert groups, ``rotary_dim`` by ``head_dim``).
- :data:`PER_LAYER_RULES`: lists with one entry per layer that one architecture reads
  (SmolLM3's ``no_rope_layers``): ``num_hidden_layers`` long, each entry checked.
  :data:`FAMILY_RELATIONS`: one architecture's (expert groups, ``rotary_dim`` by ``head_dim``);
- :data:`FAMILY_IGNORED`: top-level keys an architecture does not read, left unchecked.

Values must be JSON numbers: a string (``"nan"``) or a boolean is refused, and so are NaN
and infinities. Integers are required where ``transformers`` uses the value as a count.
No torch: the coordinator runs this (tpserve/model_config.py).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tpserve.model_registry import SLIDING_WINDOW_RULES


@dataclass(frozen=True)
class Check:
    """What one field must be: ``test(value)`` true, described as ``expect`` in the refusal."""

    test: Callable[[Any], bool]
    expect: str


@dataclass(frozen=True)
class Relation:
    """A rule between fields, checked once each field has passed its own: ``test(*values)``."""

    fields: tuple[str, ...]
    test: Callable[..., bool]
    expect: str


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    if _is_int(value):
        return abs(value) <= sys.float_info.max  # compared exactly: float() of a larger int would overflow
    return isinstance(value, float) and math.isfinite(value)


POSITIVE_INT = Check(lambda v: _is_int(v) and v >= 1, "a positive integer")
NON_NEGATIVE_INT = Check(lambda v: _is_int(v) and v >= 0, "an integer >= 0")
POSITIVE = Check(lambda v: _is_finite(v) and v > 0, "a finite number > 0")
FINITE = Check(_is_finite, "a finite number")
AT_LEAST_ONE = Check(lambda v: _is_finite(v) and v >= 1, "a finite number >= 1")
FRACTION = Check(lambda v: _is_finite(v) and 0 < v <= 1, "a number in (0, 1]")
EVEN_INT = Check(lambda v: _is_int(v) and v >= 2 and v % 2 == 0, "a positive even integer (RoPE rotates pairs)")
#: The gated MLP's SiLU (SwiGLU), the one activation of every family but the GELU ones below; another name would be
#: refused by each rank as it builds the model (worker/models/llama.py ``hidden_acts``), after the start-up cost.
SILU = Check(lambda v: v == "silu", '"silu" (the gated MLP\'s activation)')
#: The GELUs the GELU families compute (worker/models/gemma2.py ``GELU_APPROXIMATIONS``): tanh-approximated or exact.
GELU = Check(lambda v: v in ("gelu_pytorch_tanh", "gelu"), '"gelu_pytorch_tanh" or "gelu"')

#: Top-level keys every family reads.
MODEL_RULES: dict[str, Check] = {
    "vocab_size": POSITIVE_INT,
    "hidden_size": POSITIVE_INT,
    "intermediate_size": POSITIVE_INT,
    "num_hidden_layers": POSITIVE_INT,
    "num_attention_heads": POSITIVE_INT,
    "num_key_value_heads": POSITIVE_INT,
    "head_dim": EVEN_INT,
    "max_position_embeddings": POSITIVE_INT,
    "original_max_position_embeddings": POSITIVE_INT,
    "rms_norm_eps": POSITIVE,
    "rope_theta": POSITIVE,
    "sliding_window": POSITIVE_INT,
    "max_window_layers": NON_NEGATIVE_INT,
    "partial_rotary_factor": FRACTION,
    "hidden_act": SILU,
}

_QWEN_MOE: dict[str, Check] = {
    "num_experts": NON_NEGATIVE_INT,  # 0: every layer dense (transformers' Qwen2MoeDecoderLayer)
    "num_local_experts": NON_NEGATIVE_INT,
    "num_experts_per_tok": POSITIVE_INT,
    "moe_intermediate_size": POSITIVE_INT,
    "decoder_sparse_step": POSITIVE_INT,
}
#: DeepSeek-V3-style sigmoid routing (worker/layers/moe_routing.py): DeepSeek V3, Kimi K2, GLM-4.5.
DEEPSEEK_MOE_RULES: dict[str, Check] = {
    "n_routed_experts": POSITIVE_INT,
    "num_experts_per_tok": POSITIVE_INT,
    "moe_intermediate_size": POSITIVE_INT,
    "n_shared_experts": NON_NEGATIVE_INT,
    "n_group": POSITIVE_INT,
    "topk_group": POSITIVE_INT,
    "routed_scaling_factor": POSITIVE,
    "first_k_dense_replace": NON_NEGATIVE_INT,
}
#: Between the keys of :data:`DEEPSEEK_MOE_RULES` (``transformers``' router would fail or mis-route otherwise).
DEEPSEEK_MOE_RELATIONS: tuple[Relation, ...] = (
    Relation(("topk_group", "n_group"), lambda k, n: k <= n, "topk_group must be at most n_group"),
    Relation(("num_experts_per_tok", "n_routed_experts"), lambda k, n: k <= n,
             "num_experts_per_tok must be at most n_routed_experts"),
    Relation(("n_routed_experts", "n_group"), lambda e, n: e % n == 0,
             "n_routed_experts must be divisible by n_group (experts are grouped evenly)"),
    Relation(("n_routed_experts", "n_group"), lambda e, n: n == 1 or e // n >= 2,
             "n_routed_experts / n_group must be >= 2 (a group is scored by its two best experts)"),
    Relation(("num_experts_per_tok", "topk_group", "n_routed_experts", "n_group"),
             lambda k, g, e, n: k <= g * (e // n),
             "num_experts_per_tok must be at most topk_group * n_routed_experts / n_group (the kept groups' experts)"),
)
_GEMMA: dict[str, Check] = {
    "hidden_activation": GELU,  # Gemma's MLP reads this key; ``hidden_act`` is ignored (FAMILY_IGNORED)
    "query_pre_attn_scalar": POSITIVE,
    "attn_logit_softcapping": POSITIVE,
    "final_logit_softcapping": POSITIVE,
}

_EXAONE4_PATTERN = Check(lambda v: (_is_int(v) and v >= 1) or (isinstance(v, str) and v != "" and set(v) <= {"L", "G"}),
                         "a positive integer (every n-th layer global) or a string of 'L' (local) and 'G' (global)")
#: Multi-head latent attention (DeepSeek V2/V3, Kimi K2; worker/layers/mla.py), with DeepSeek V3's MoE keys.
_DEEPSEEK_V3: dict[str, Check] = {
    # V3's router (sigmoid scores, bias-corrected group top-k); transformers ignores both keys and routes so
    # whatever they say: a checkpoint naming V2's softmax or greedy routing would be served another router.
    "scoring_func": Check(lambda v: v == "sigmoid", '"sigmoid" (DeepSeek V3\'s routing; V2\'s softmax is not served)'),
    "topk_method": Check(lambda v: v == "noaux_tc",
                         '"noaux_tc" (DeepSeek V3\'s bias-corrected group routing; V2\'s greedy methods are not served)'),
    "kv_lora_rank": POSITIVE_INT,
    "q_lora_rank": POSITIVE_INT,  # null: a full-rank q_proj
    "qk_rope_head_dim": EVEN_INT,
    "qk_nope_head_dim": POSITIVE_INT,
    "v_head_dim": POSITIVE_INT,
    **DEEPSEEK_MOE_RULES,
}

def _time_step_limit(value: Any) -> bool:
    """``[min, max]`` with ``0 <= min <= max`` (``max`` may be ``Infinity``, or ``transformers`` 5's
    ``{"__float__": "Infinity"}`` tag)."""
    if not isinstance(value, list) or len(value) != 2:
        return False
    bounds = [math.inf if isinstance(v, dict) and v.get("__float__") == "Infinity" else v for v in value]
    numbers = all(_is_finite(v) or v == math.inf for v in bounds)
    return numbers and 0 <= bounds[0] <= bounds[1] and bounds[0] != math.inf


_BOOL = Check(lambda v: isinstance(v, bool), "true or false")
_CONV_KERNEL = Check(lambda v: _is_int(v) and v >= 2, "an integer >= 2 (the conv state keeps kernel - 1 inputs)")
_TIME_STEP_LIMIT = Check(_time_step_limit, "[min, max] with 0 <= min <= max (max may be Infinity)")
#: Granite 4 hybrid (worker/models/granite_moe_hybrid.py): Mamba-2 sizes, MoE, Granite's multipliers.
_GRANITE_MOE_HYBRID: dict[str, Check] = {
    "mamba_n_heads": POSITIVE_INT, "mamba_n_groups": POSITIVE_INT, "mamba_d_state": POSITIVE_INT,
    "mamba_d_conv": _CONV_KERNEL, "mamba_expand": POSITIVE_INT, "mamba_chunk_size": POSITIVE_INT,
    "mamba_d_head": Check(lambda v: v == "auto" or (_is_int(v) and v >= 1), 'a positive integer or "auto"'),
    "mamba_conv_bias": _BOOL, "mamba_proj_bias": _BOOL, "time_step_limit": _TIME_STEP_LIMIT,
    "num_local_experts": NON_NEGATIVE_INT, "num_experts_per_tok": POSITIVE_INT, "shared_intermediate_size": POSITIVE_INT,
    "position_embedding_type": Check(lambda v: v in ("rope", "nope"), '"rope" or "nope" (or null: no RoPE)'),
    "embedding_multiplier": POSITIVE, "residual_multiplier": POSITIVE, "attention_multiplier": POSITIVE,
    "logits_scaling": POSITIVE,
}
#: Nemotron-H (worker/models/nemotron_h.py): Mamba-2 sizes, the relu^2 MLPs, DeepSeek-style MoE routing.
_NEMOTRON_H: dict[str, Check] = {
    "mamba_num_heads": POSITIVE_INT, "mamba_head_dim": POSITIVE_INT, "n_groups": POSITIVE_INT,
    "mamba_n_groups": POSITIVE_INT, "ssm_state_size": POSITIVE_INT, "conv_kernel": _CONV_KERNEL,
    "mamba_d_conv": _CONV_KERNEL, "chunk_size": POSITIVE_INT, "mamba_chunk_size": POSITIVE_INT,
    "use_conv_bias": _BOOL, "use_bias": _BOOL, "mlp_bias": _BOOL, "time_step_limit": _TIME_STEP_LIMIT,
    "layer_norm_epsilon": POSITIVE, "moe_shared_expert_intermediate_size": POSITIVE_INT,
    "mamba_hidden_act": Check(lambda v: v == "silu", '"silu" (the convolution\'s activation)'),
    "mlp_hidden_act": Check(lambda v: v == "relu2", '"relu2" (the MLPs\' squared ReLU)'),
    "moe_latent_size": Check(lambda v: False, "null (the latent MoE projection is not supported)"),
    **DEEPSEEK_MOE_RULES,
}
#: Heads per B/C group, and (Granite) the heads' width against the inner width.
_MAMBA2_RELATIONS: dict[str, tuple[Relation, ...]] = {
    "GraniteMoeHybridForCausalLM": (
        Relation(("mamba_n_heads", "mamba_n_groups"), lambda h, g: h % g == 0,
                 "mamba_n_heads must be a multiple of mamba_n_groups (each B/C group serves whole heads)"),
        Relation(("mamba_n_heads", "mamba_d_head", "mamba_expand", "hidden_size"), lambda h, d, e, w: h * d == e * w,
                 "mamba_n_heads * mamba_d_head must equal mamba_expand * hidden_size (the Mamba inner width)"),
    ),
    "NemotronHForCausalLM": (
        Relation(("mamba_num_heads", "n_groups"), lambda h, g: h % g == 0,
                 "mamba_num_heads must be a multiple of n_groups (each B/C group serves whole heads)"),
        *DEEPSEEK_MOE_RELATIONS,
    ),
}
#: Gated DeltaNet's sizes (worker/layers/gated_delta_net.py): Qwen3-Next, Qwen3.5 and Qwen3.5-MoE.
_GATED_DELTA_NET: dict[str, Check] = {
    "linear_num_key_heads": POSITIVE_INT,
    "linear_num_value_heads": POSITIVE_INT,
    "linear_key_head_dim": POSITIVE_INT,
    "linear_value_head_dim": POSITIVE_INT,
    "linear_conv_kernel_dim": POSITIVE_INT,
    "full_attention_interval": POSITIVE_INT,
}
_GATED_DELTA_NET_RELATIONS: tuple[Relation, ...] = (
    Relation(("linear_num_value_heads", "linear_num_key_heads"), lambda v, k: v % k == 0,
             "linear_num_value_heads must be a multiple of linear_num_key_heads (each key head serves a group)"),
)
_HYBRID_MOE: dict[str, Check] = {**_GATED_DELTA_NET, **_QWEN_MOE, "shared_expert_intermediate_size": POSITIVE_INT}

#: Keys one architecture reads (worker/models/<family>.py's ``hf_value`` calls).
FAMILY_RULES: dict[str, dict[str, Check]] = {
    "MixtralForCausalLM": {"num_local_experts": POSITIVE_INT, "num_experts_per_tok": POSITIVE_INT},
    "Qwen2MoeForCausalLM": {**_QWEN_MOE, "shared_expert_intermediate_size": POSITIVE_INT},
    "Qwen3MoeForCausalLM": _QWEN_MOE,
    "Gemma2ForCausalLM": _GEMMA,
    "DeepseekV3ForCausalLM": _DEEPSEEK_V3,
    "Glm4MoeLiteForCausalLM": _DEEPSEEK_V3,
    "Gemma3ForCausalLM": {**_GEMMA, "rope_local_base_freq": POSITIVE, "sliding_window_pattern": POSITIVE_INT},
    # gpt-oss: the experts' clamped SwiGLU (a limit <= 0 would clamp every gate to <= 0).
    "GptOssForCausalLM": {"num_local_experts": POSITIVE_INT, "num_experts_per_tok": POSITIVE_INT,
                          "swiglu_limit": POSITIVE, "swiglu_alpha": POSITIVE},
    "Glm4MoeForCausalLM": DEEPSEEK_MOE_RULES,
    "MiniMaxM2ForCausalLM": {"num_local_experts": POSITIVE_INT, "num_experts_per_tok": POSITIVE_INT,
                             "rotary_dim": EVEN_INT},
    "Ernie4_5_MoeForCausalLM": {"moe_num_experts": POSITIVE_INT, "moe_k": POSITIVE_INT,
                                "moe_intermediate_size": POSITIVE_INT, "moe_num_shared_experts": NON_NEGATIVE_INT,
                                "moe_layer_start_index": NON_NEGATIVE_INT, "moe_layer_interval": POSITIVE_INT,
                                "moe_layer_end_index": Check(lambda v: _is_int(v) and v >= -1, "an integer >= -1"),
                                "moe_norm_min": POSITIVE,
                                "use_bias": Check(lambda v: v is False, "false (biased Ernie 4.5 projections and LM "
                                                  "head are not supported; the released checkpoints have none)")},
    # Granite's four multipliers: a zero or negative one zeroes or flips the embedding, the residual
    # branches, the attention scores or the logits.
    "GraniteForCausalLM": {"embedding_multiplier": POSITIVE, "residual_multiplier": POSITIVE,
                           "attention_multiplier": POSITIVE, "logits_scaling": POSITIVE},
    "CohereForCausalLM": {"layer_norm_eps": POSITIVE, "logit_scale": POSITIVE},
    "Starcoder2ForCausalLM": {"norm_epsilon": POSITIVE, "hidden_act": GELU},
    "Llama4ForCausalLM": {"attention_chunk_size": POSITIVE_INT, "num_local_experts": POSITIVE_INT,
                          "num_experts_per_tok": POSITIVE_INT, "intermediate_size_mlp": POSITIVE_INT,
                          "interleave_moe_layer_step": POSITIVE_INT, "no_rope_layer_interval": POSITIVE_INT,
                          "floor_scale": POSITIVE, "attn_scale": FINITE},
    "SmolLM3ForCausalLM": {"no_rope_layer_interval": POSITIVE_INT},
    "Exaone4ForCausalLM": {"sliding_window_pattern": _EXAONE4_PATTERN},
    "GraniteMoeHybridForCausalLM": _GRANITE_MOE_HYBRID,
    "NemotronHForCausalLM": _NEMOTRON_H,
    "Qwen3NextForCausalLM": _HYBRID_MOE,
    "Qwen3_5ForCausalLM": _GATED_DELTA_NET,
    "Qwen3_5MoeForCausalLM": _HYBRID_MOE,
    # LFM2: the short convolution's kernel (its state keeps conv_L_cache - 1 inputs) and the MLP's width rule.
    "Lfm2ForCausalLM": {"norm_eps": POSITIVE, "conv_L_cache": Check(lambda v: _is_int(v) and v >= 2,
                                                                    "an integer >= 2"),
                        "conv_bias": Check(lambda v: isinstance(v, bool), "true or false"),
                        "block_auto_adjust_ff_dim": Check(lambda v: isinstance(v, bool), "true or false"),
                        "block_multiple_of": POSITIVE_INT, "block_ffn_dim_multiplier": POSITIVE},
}

#: Per architecture, the keys that list one value per layer, and what each value must be.
PER_LAYER_RULES: dict[str, dict[str, Check]] = {
    "SmolLM3ForCausalLM": {"no_rope_layers": Check(lambda v: v in (0, 1) and not isinstance(v, float),
                                                   "0 (no RoPE) or 1 (RoPE)")},
}

#: Keys of a RoPE dict (``rope_scaling``, ``rope_parameters`` or one layer type's), as written.
#: ``factor`` > 0 here; ``dynamic`` asks for >= 1 (:data:`ROPE_TYPE_RULES`).
ROPE_RULES: dict[str, Check] = {
    "rope_theta": POSITIVE,
    "factor": POSITIVE,
    "original_max_position_embeddings": POSITIVE_INT,
    "low_freq_factor": POSITIVE,
    "high_freq_factor": POSITIVE,
    "beta_fast": POSITIVE,
    "beta_slow": POSITIVE,
    "attention_factor": POSITIVE,
    "mscale": FINITE,
    "mscale_all_dim": FINITE,
    "partial_rotary_factor": FRACTION,
}

#: Per ``rope_type``, rules that replace :data:`ROPE_RULES`' for the same key: a dynamic factor below 1 would
#: shorten the model's context below ``max_position_embeddings`` (to 0 at factor 0, where every
#: request is refused as too long).
ROPE_TYPE_RULES: dict[str, dict[str, Check]] = {"dynamic": {"factor": AT_LEAST_ONE}}


#: Rules between top-level keys; a relation whose fields are not all present is skipped.
RELATIONS: tuple[Relation, ...] = (
    Relation(("num_attention_heads", "num_key_value_heads"), lambda q, kv: q % kv == 0,
             "num_attention_heads must be a multiple of num_key_value_heads (each key/value head serves a group)"),
    Relation(("num_experts_per_tok", "num_local_experts"), lambda k, n: n == 0 or k <= n,
             "num_experts_per_tok must be at most num_local_experts"),
    Relation(("num_experts_per_tok", "num_experts"), lambda k, n: n == 0 or k <= n,
             "num_experts_per_tok must be at most num_experts"),
)
#: Rules between one architecture's keys, as :data:`FAMILY_RULES`.
FAMILY_RELATIONS: dict[str, tuple[Relation, ...]] = {
    **_MAMBA2_RELATIONS,
    "Glm4MoeForCausalLM": DEEPSEEK_MOE_RELATIONS,
    "DeepseekV3ForCausalLM": DEEPSEEK_MOE_RELATIONS,
    "Glm4MoeLiteForCausalLM": DEEPSEEK_MOE_RELATIONS,
    "MiniMaxM2ForCausalLM": (Relation(("rotary_dim", "head_dim"), lambda r, d: r <= d,
                                      "rotary_dim must be at most head_dim (the rotated part of a head)"),),
    "Ernie4_5_MoeForCausalLM": (Relation(("moe_k", "moe_num_experts"), lambda k, n: k <= n,
                                         "moe_k must be at most moe_num_experts"),),
    "Qwen3NextForCausalLM": _GATED_DELTA_NET_RELATIONS,
    "Qwen3_5ForCausalLM": _GATED_DELTA_NET_RELATIONS,
    "Qwen3_5MoeForCausalLM": _GATED_DELTA_NET_RELATIONS,
}
#: Top-level keys an architecture never reads, so not checked: latent attention has no key/value heads
#: (DeepseekV3Config writes its default of 128 whatever the query heads); Gemma's MLP reads ``hidden_activation``,
#: Nemotron-H's ``mlp_hidden_act`` and ``mamba_hidden_act``, not ``hidden_act``.
FAMILY_IGNORED: dict[str, tuple[str, ...]] = {"DeepseekV3ForCausalLM": ("num_key_value_heads",),
                                              "Glm4MoeLiteForCausalLM": ("num_key_value_heads",),
                                              "Gemma2ForCausalLM": ("hidden_act",),
                                              "Gemma3ForCausalLM": ("hidden_act",),
                                              "NemotronHForCausalLM": ("hidden_act",)}
#: Rules between keys of one RoPE dict.
ROPE_RELATIONS: tuple[Relation, ...] = (
    Relation(("low_freq_factor", "high_freq_factor"), lambda low, high: high > low,
             "high_freq_factor must be greater than low_freq_factor (Llama 3's smoothing divides by their difference)"),
)


def check_fields(values: Mapping[str, Any], rules: Mapping[str, Check], where: str = "") -> None:
    """Check each field of ``rules`` present (not None) in ``values``.

    Args:
        values: a config dict (or a RoPE dict of it).
        rules: field -> its :class:`Check`.
        where: the dict's place in config.json, prefixed to field names (``"rope_scaling."``).

    Raises:
        ValueError: the first field that fails, named with its value, e.g.
            ``config.json rope_theta=0 must be a finite number > 0``.
    """
    for key, check in rules.items():
        value = values.get(key)
        if value is not None and not check.test(value):
            raise ValueError(f"config.json {where}{key}={_show(value)} must be {check.expect}")


def check_relations(values: Mapping[str, Any], relations: tuple[Relation, ...], where: str = "") -> None:
    """Check each relation whose fields are all present in ``values`` as numbers.

    Raises:
        ValueError: naming every field of the failed relation with its value.
    """
    for relation in relations:
        if not all(_is_finite(values.get(key)) for key in relation.fields):
            continue  # absent, or a key this family does not read (never checked alone)
        if not relation.test(*(values[key] for key in relation.fields)):
            named = ", ".join(f"{where}{key}={_show(values[key])}" for key in relation.fields)
            raise ValueError(f"config.json {named}: {relation.expect}")


def check_config(raw: Mapping[str, Any], architecture: str) -> None:
    """Refuse nonsense in a whole ``config.json`` (top-level keys, the family's, the RoPE dicts).

    Args:
        raw: the parsed config.json.
        architecture: the served architecture (a key of :data:`FAMILY_RULES`, or not).

    Raises:
        ValueError: one line naming the first bad field and its value.
    """
    rules = {**MODEL_RULES, **FAMILY_RULES.get(architecture, {})}
    if raw.get("use_sliding_window") is False or architecture not in SLIDING_WINDOW_RULES:
        rules.pop("sliding_window")  # the window is not read (transformers writes 0 or null there, or ignores it)
    ignored = FAMILY_IGNORED.get(architecture, ())
    raw = {key: value for key, value in raw.items() if key not in ignored}
    check_fields(raw, rules)
    check_relations(raw, (*RELATIONS, *FAMILY_RELATIONS.get(architecture, ())))
    check_relations(raw, RELATIONS)
    check_per_layer(raw, PER_LAYER_RULES.get(architecture, {}))
    for where, rope in _rope_dicts(raw):
        check_rope(rope, where)


def check_per_layer(raw: Mapping[str, Any], rules: Mapping[str, Check]) -> None:
    """Check each per-layer list of ``rules`` present in ``raw``: a list of ``num_hidden_layers`` values,
    each passing its :class:`Check` (``num_hidden_layers`` itself already checked).

    Raises:
        ValueError: one line naming the field, its value and what it must be.
    """
    layers = raw.get("num_hidden_layers")
    for key, check in rules.items():
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or len(value) != layers or not all(check.test(v) for v in value):
            raise ValueError(f"config.json {key}={_show(value)} must list one value per layer "
                             f"(num_hidden_layers={_show(layers)}), each {check.expect}")


def check_rope(rope: Mapping[str, Any], where: str) -> None:
    """Check one RoPE dict as written: its fields, those of its ``rope_type``, their relations.

    Raises:
        ValueError: naming the field as ``<where><key>``.
    """
    rope_type = rope.get("rope_type", rope.get("type"))
    by_type = ROPE_TYPE_RULES.get(rope_type, {}) if isinstance(rope_type, str) else {}
    check_fields(rope, {**ROPE_RULES, **by_type}, where)  # the type's rule replaces the general one
    check_relations(rope, ROPE_RELATIONS, where)


def _rope_dicts(raw: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """Every RoPE dict of the config with its place: ``rope_scaling``, ``rope_parameters``, and
    ``rope_parameters``' dicts nested by layer type (``transformers`` 5)."""
    found = []
    for key in ("rope_scaling", "rope_parameters"):
        value = raw.get(key)
        if not isinstance(value, Mapping):
            continue
        nested = [(name, sub) for name, sub in value.items() if isinstance(sub, Mapping)]
        if nested:
            found += [(f"{key}.{name}.", sub) for name, sub in nested]
        else:
            found.append((f"{key}.", value))
    return found


def _show(value: Any) -> str:
    """A value as config.json writes it (``"nan"`` for a string, ``NaN`` for a float, ``0`` for zero)."""
    return json.dumps(value)
