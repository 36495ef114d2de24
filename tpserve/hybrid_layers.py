"""Which decoder layers of a hybrid model keep a per-sequence state instead of a KV cache.

Hybrid families (LFM2: short convolutions; Qwen3-Next / Qwen3.5: Gated DeltaNet; Granite 4 /
Nemotron-H: Mamba-2) name each layer's kind in ``config.json``'s ``layer_types``. The attention
kinds (``"full_attention"``, ``"sliding_attention"``) get paged KV blocks; the *state* kinds of
:data:`STATE_LAYER_TYPES` get one state slot per sequence (worker/state_metadata.py). The KV
cache is then sized and allocated for the attention layers only (tpserve/model_config.py's
``num_attention_layers``, worker/kv_cache.py), the state pool for the state layers
(worker/state_cache.py). No torch: the coordinator reads this at start-up.

Some families spell their layer list in their own words, normalised here to ``transformers`` 5's
names (:func:`hybrid_layer_types`):

- Granite 4 hybrid (``GraniteMoeHybridForCausalLM``): ``layer_types`` of ``"mamba"`` / ``"attention"``
  as the Hub's configs write them, or ``"linear_attention"`` / ``"full_attention"`` as ``transformers``
  5 saves them (its ``_LEGACY_LAYER_TYPE_REMAP``);
- Nemotron-H (``NemotronHForCausalLM``): ``hybrid_override_pattern``, one character per layer
  (``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` mixture of experts) as the Hub writes it, or
  ``layers_block_type`` (``"linear_attention"``, ``"full_attention"``, ``"mlp"``, ``"moe"``) as
  ``transformers`` 5 saves it; the layer count is the list's length when ``num_hidden_layers`` is
  absent. Its ``"mlp"`` and ``"moe"`` layers have neither a KV cache nor a state
  (:data:`STATELESS_LAYER_TYPES`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tpserve.model_registry import LINEAR_ATTENTION_ARCHITECTURES

#: Gated DeltaNet layers (linear attention; worker/layers/gated_delta_net.py): Qwen3-Next, Qwen3.5, Qwen3.5-MoE.
LINEAR_ATTENTION = "linear_attention"

#: Per hybrid architecture, the ``layer_types`` values that name a state layer. A family that adds
#: a state layer kind adds its architecture here (and its kind's layer in worker/layers/).
STATE_LAYER_TYPES: dict[str, frozenset[str]] = {
    "Lfm2ForCausalLM": frozenset({"conv"}),
    "GraniteMoeHybridForCausalLM": frozenset({"linear_attention"}),  # Mamba-2 (worker/layers/mamba2.py)
    "NemotronHForCausalLM": frozenset({"linear_attention"}),
    **{architecture: frozenset({LINEAR_ATTENTION}) for architecture in LINEAR_ATTENTION_ARCHITECTURES},
}
#: Per architecture, the ``layer_types`` values of layers with neither a KV cache nor a state.
STATELESS_LAYER_TYPES: dict[str, frozenset[str]] = {
    "NemotronHForCausalLM": frozenset({"mlp", "moe"}),
}
#: The Hub's older names (``transformers``' ``_LEGACY_LAYER_TYPE_REMAP``).
_LEGACY_NAMES = {"mamba": "linear_attention", "attention": "full_attention"}
#: Nemotron-H's ``hybrid_override_pattern`` characters.
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def state_layer_types(architecture: str) -> frozenset[str]:
    """The state layer kinds ``architecture`` accepts in ``layer_types`` (empty: attention only)."""
    return STATE_LAYER_TYPES.get(architecture, frozenset())


def stateless_layer_types(architecture: str) -> frozenset[str]:
    """The layer kinds ``architecture`` accepts that hold neither a KV cache nor a state (empty: none)."""
    return STATELESS_LAYER_TYPES.get(architecture, frozenset())


def hybrid_layer_types(raw: Mapping[str, Any], architecture: str) -> list[str] | None:
    """Granite 4 hybrid's or Nemotron-H's per-layer types in ``transformers`` 5's names; None for
    another family (or a config that lists none).

    Raises:
        ValueError: a layer list that is not a list of names, or a pattern with another character
            (one line naming the key).
    """
    if architecture not in ("GraniteMoeHybridForCausalLM", "NemotronHForCausalLM"):
        return None
    pattern = raw.get("hybrid_override_pattern")
    listed = raw.get("layers_block_type") or raw.get("layer_types")
    if listed is None and pattern is not None and architecture == "NemotronHForCausalLM":
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(_PATTERN):
            raise ValueError(f"config.json hybrid_override_pattern={pattern!r} must be a non-empty string of "
                             f"{', '.join(repr(c) for c in _PATTERN)} (Mamba-2, attention, MLP, MoE layers)")
        return [_PATTERN[c] for c in pattern]
    if listed is None:
        return None
    if not isinstance(listed, list) or not all(isinstance(t, str) for t in listed):
        raise ValueError(f"config.json layer_types={listed!r} must be a list of layer type names")
    return [_LEGACY_NAMES.get(str(t), str(t)) for t in listed]


def hybrid_num_layers(raw: Mapping[str, Any], architecture: str) -> int | None:
    """Nemotron-H's layer count when config.json omits ``num_hidden_layers`` (``transformers`` 5 derives it
    from ``layers_block_type``); None otherwise."""
    if architecture != "NemotronHForCausalLM" or raw.get("num_hidden_layers") is not None:
        return None
    types = hybrid_layer_types(raw, architecture)
    return None if types is None else len(types)


def default_hybrid_layer_types(raw: Mapping[str, Any], architecture: str, num_hidden_layers: int) -> list[str] | None:
    """``layer_types`` of a hybrid config that says its layers' kinds another way (None: not such a config).

    LFM2 configs from before ``layer_types`` name the attention layers in ``full_attn_idxs``
    (``transformers``' Lfm2Config: every other layer is ``"conv"``). Qwen3-Next / Qwen3.5 configs without
    ``layer_types``: every ``full_attention_interval``-th layer (default 4) attends, the others are Gated
    DeltaNet (``Qwen3NextConfig``'s rule). A family whose config spells
    its kinds otherwise (a pattern string, say) adds its rule here, so that ``ModelConfig.layer_types``
    is always one kind per layer.

    Raises:
        ValueError: ``full_attn_idxs`` is not a list of layer indices.
    """
    if architecture in LINEAR_ATTENTION_ARCHITECTURES:
        interval = raw.get("full_attention_interval", 4)  # a positive integer (tpserve/model_config_rules.py)
        return [LINEAR_ATTENTION if (i + 1) % interval else "full_attention" for i in range(num_hidden_layers)]
    indices = raw.get("full_attn_idxs")
    if architecture != "Lfm2ForCausalLM" or indices is None:
        return None
    if not isinstance(indices, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                 and 0 <= i < num_hidden_layers for i in indices):
        raise ValueError(f"config.json full_attn_idxs={indices!r} must list layer indices below "
                         f"num_hidden_layers={num_hidden_layers}")
    return ["full_attention" if i in indices else "conv" for i in range(num_hidden_layers)]
