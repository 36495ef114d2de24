"""OLMo 3 (``Olmo3ForCausalLM``): OLMo 2 with three sliding-window layers to one of full attention.

Reference: ``transformers``' ``modeling_olmo3.py``. The layer is OLMo 2's
(worker/models/olmo2.py: post-norms, full-width QK norm); what changes is per layer type:

    layer i:  "sliding_attention" (window sliding_window)  or  "full_attention"
              layer_types; default: every 4th layer full, the others sliding (Olmo3Config)
    RoPE:     each type its own (rope_parameters nested by layer type; an old flat
              rope_scaling applies to the full-attention layers only, as Olmo3Config does)

The step computes one ``(cos, sin)`` per distinct RoPE and each layer takes its type's
(worker/models/olmo2.py's :class:`~worker.models.olmo2.OlmoModel`). Every attention path takes the window (worker/attention.py).
"""

from __future__ import annotations

from typing import Any

from tpserve.model_config import LAYER_TYPES, ModelConfig
from worker.models.olmo2 import Olmo2ForCausalLM


def olmo3_layer_types(config: ModelConfig) -> tuple[str, ...]:
    """The config's ``layer_types``, else ``Olmo3Config``'s default: every fourth layer full, the rest sliding."""
    if config.hf_config.get("layer_types") is not None:
        return config.layer_types
    return tuple("full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                 for i in range(config.num_hidden_layers))


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3: :class:`~worker.models.olmo2.Olmo2ForCausalLM` with sliding-window layers and RoPE per layer type."""

    def layer_types(self, config: ModelConfig) -> tuple[str, ...]:
        """The config's ``layer_types``, else every fourth layer full and the rest sliding."""
        return olmo3_layer_types(config)

    def ropes(self, config: ModelConfig) -> dict[str, tuple[float, dict[str, Any] | None]]:
        """Each type's nested ``rope_parameters``; a flat ``rope_scaling`` scales the full-attention layers only."""
        if config.layer_rope_parameters:
            return {t: config.layer_rope(t) for t in LAYER_TYPES}
        return {"full_attention": (config.rope_theta, config.rope_scaling), "sliding_attention": (config.rope_theta, None)}
