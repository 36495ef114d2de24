"""The layer types of hybrid families, as their ``config.json`` spells them: state layers beside attention.

Hybrid checkpoints say, per layer, what the layer is, each family in its own words:

- Granite 4 hybrid (``GraniteMoeHybridForCausalLM``): ``layer_types`` of ``"mamba"`` / ``"attention"``
  as the Hub's configs write them, or ``"linear_attention"`` / ``"full_attention"`` as ``transformers``
  5 saves them (its ``_LEGACY_LAYER_TYPE_REMAP``);
- Nemotron-H (``NemotronHForCausalLM``): ``hybrid_override_pattern``, one character per layer
  (``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` mixture of experts) as the Hub writes it, or
  ``layers_block_type`` (``"linear_attention"``, ``"full_attention"``, ``"mlp"``, ``"moe"``) as
  ``transformers`` 5 saves it; the layer count is the list's length (``num_hidden_layers``, when
  present, is the same number).

Both normalise to ``transformers`` 5's names: :data:`STATE_LAYER` for a layer with a per-sequence
state instead of a KV cache, ``"full_attention"`` for attention, and Nemotron-H's ``"mlp"`` and
``"moe"`` for layers with neither. No torch: the coordinator reads it (tpserve/model_config.py).
"""

from __future__ import annotations

from typing import Any

#: A layer with a fixed-size per-sequence state (Mamba-2 here) instead of a KV cache.
STATE_LAYER = "linear_attention"
#: Layers with neither a KV cache nor a state (Nemotron-H's MLP-only and MoE-only layers).
STATELESS_LAYERS = ("mlp", "moe")
#: The layer types each hybrid architecture accepts beyond ``full_attention``.
HYBRID_LAYER_TYPES: dict[str, tuple[str, ...]] = {
    "GraniteMoeHybridForCausalLM": (STATE_LAYER,),
    "NemotronHForCausalLM": (STATE_LAYER, *STATELESS_LAYERS),
}
#: The Hub's older names (``transformers``' ``_LEGACY_LAYER_TYPE_REMAP``).
_LEGACY_NAMES = {"mamba": STATE_LAYER, "attention": "full_attention"}
#: Nemotron-H's ``hybrid_override_pattern`` characters.
_PATTERN = {"M": STATE_LAYER, "*": "full_attention", "-": "mlp", "E": "moe"}


def hybrid_layer_types(raw: dict[str, Any], architecture: str) -> list[str] | None:
    """A hybrid family's per-layer types in ``transformers`` 5's names; None for another family.

    Raises:
        ValueError: a layer list that is not a list of known types, or a pattern with another character
            (one line naming the key).
    """
    if architecture not in HYBRID_LAYER_TYPES:
        return None
    pattern = raw.get("hybrid_override_pattern")
    listed = raw.get("layers_block_type") or raw.get("layer_types")
    if listed is None and isinstance(pattern, str) and architecture == "NemotronHForCausalLM":
        unknown = sorted(set(pattern) - set(_PATTERN))
        if unknown or not pattern:
            raise ValueError(f"config.json hybrid_override_pattern={pattern!r} must be a non-empty string of "
                             f"{', '.join(repr(c) for c in _PATTERN)} (Mamba-2, attention, MLP, MoE layers)")
        return [_PATTERN[c] for c in pattern]
    if listed is None:
        return None
    if not isinstance(listed, list) or not all(isinstance(t, str) for t in listed):
        raise ValueError(f"config.json layer_types={listed!r} must be a list of layer type names")
    return [_LEGACY_NAMES.get(t, t) for t in listed]


def hybrid_num_layers(raw: dict[str, Any], architecture: str) -> int | None:
    """Nemotron-H's layer count when config.json omits ``num_hidden_layers`` (``transformers`` 5 derives it
    from ``layers_block_type``); None otherwise."""
    if architecture != "NemotronHForCausalLM" or raw.get("num_hidden_layers") is not None:
        return None
    types = hybrid_layer_types(raw, architecture)
    return None if types is None else len(types)
