"""Which decoder layers of a hybrid model keep a per-sequence state instead of a KV cache.

Hybrid families (LFM2: short convolutions; Qwen3-Next / Qwen3.5: Gated DeltaNet; Granite 4 /
Nemotron-H: Mamba-2) name each layer's kind in ``config.json``'s ``layer_types``. The attention
kinds (``"full_attention"``, ``"sliding_attention"``) get paged KV blocks; the *state* kinds of
:data:`STATE_LAYER_TYPES` get one state slot per sequence (worker/state_metadata.py). The KV
cache is then sized and allocated for the attention layers only (tpserve/model_config.py's
``num_attention_layers``, worker/kv_cache.py), the state pool for the state layers
(worker/state_cache.py). No torch: the coordinator reads this at start-up.
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
    **{architecture: frozenset({LINEAR_ATTENTION}) for architecture in LINEAR_ATTENTION_ARCHITECTURES},
}


def state_layer_types(architecture: str) -> frozenset[str]:
    """The state layer kinds ``architecture`` accepts in ``layer_types`` (empty: attention only)."""
    return STATE_LAYER_TYPES.get(architecture, frozenset())


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
