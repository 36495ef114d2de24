"""RoPE's configuration: a checkpoint's ``rope_parameters`` / ``rope_scaling`` as the model reads them.

Both layouts (``transformers`` 4's ``rope_scaling`` and top-level ``rope_theta``, 5's ``rope_parameters``,
also nested by layer type) give ``(rope_theta, rope_scaling)``: the base, and None or the scaling's
parameters with ``transformers``' defaults filled in (worker/layers/rotary.py computes from them).
No torch here: the coordinator reads this too.
"""

from __future__ import annotations

from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


def config_value(raw: dict[str, Any], key: str, default: Any) -> Any:
    """``raw[key]``, or ``default`` when it is absent or null (never when it is 0: a 0 is refused, not replaced)."""
    value = raw.get(key)
    return default if value is None else value


def rope_dict(raw: dict[str, Any]) -> Any:
    """The RoPE dict ``transformers`` reads from a config.json: ``rope_scaling`` (its 4.x key) where it is set
    and not empty, else ``rope_parameters`` (5.x); None without either.

    Where both are set, ``rope_scaling`` wins whole (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``:
    ``rope_scaling or rope_parameters``, transformers 5.25): its ``rope_theta`` or the top-level one applies, not
    ``rope_parameters``'. Model cards enable YaRN by adding ``rope_scaling`` to a config that has
    ``rope_parameters`` (Qwen3's); reading ``rope_parameters`` first served such a model with plain RoPE.
    """
    return raw.get("rope_scaling") or raw.get("rope_parameters")


def parse_layer_rope(raw: dict[str, Any], max_position_embeddings: int,
                     layer_types: tuple[str, ...]) -> dict[str, tuple[float, dict[str, Any] | None]]:
    """RoPE parameters nested by layer type (``transformers`` 5), each parsed as :func:`parse_rope`; else {}."""
    params = rope_dict(raw)  # a flat rope_scaling wins over nested rope_parameters, as in transformers
    if not isinstance(params, dict) or not params or not set(params) <= set(layer_types):
        return {}
    return {layer_type: parse_rope({**raw, "rope_parameters": nested, "rope_scaling": None}, max_position_embeddings)
            for layer_type, nested in params.items() if isinstance(nested, dict)}


def parse_rope(raw: dict[str, Any], max_position_embeddings: int) -> tuple[float, dict[str, Any] | None]:
    """Return ``(rope_theta, rope_scaling)`` from either config layout.

    ``original_max_position_embeddings`` follows ``transformers``'
    ``PreTrainedConfig.standardize_rope_params``: a top-level key wins, then the
    RoPE dict's, then ``max_position_embeddings``.
    """
    params = dict(rope_dict(raw) or {})
    # The RoPE dict's base, else the top-level one, else transformers' default; a 0 is refused
    # (tpserve/model_config_rules.py), never replaced by the default.
    rope_theta = float(config_value(params, "rope_theta", config_value(raw, "rope_theta", 10000.0)))
    params.pop("rope_theta", None)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling rope_type={rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return rope_theta, None
    if rope_type == "yarn" and params.get("factor") is None:  # transformers: the ratio of the two lengths
        original = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        if original:
            params["factor"] = max_position_embeddings / original
    if params.get("factor") is None:
        raise ValueError(f"rope_scaling rope_type={rope_type!r} needs a 'factor'")
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": float(params["factor"])}
    original_max = int(
        raw.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or max_position_embeddings
    )
    if rope_type == "llama3":
        missing = [key for key in _LLAMA3_ROPE_KEYS if key not in params]
        if missing:
            raise ValueError(f"rope_scaling rope_type='llama3' is missing {missing}")
        scaling["low_freq_factor"] = float(params["low_freq_factor"])
        scaling["high_freq_factor"] = float(params["high_freq_factor"])
        scaling["original_max_position_embeddings"] = original_max
    elif rope_type == "yarn":  # defaults as transformers' _compute_yarn_parameters
        scaling["original_max_position_embeddings"] = original_max
        scaling["beta_fast"] = float(config_value(params, "beta_fast", 32))
        scaling["beta_slow"] = float(config_value(params, "beta_slow", 1))
        scaling["truncate"] = bool(params.get("truncate", True))
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            scaling[key] = None if params.get(key) is None else float(params[key])
    elif rope_type == "dynamic":  # transformers scales against max_position_embeddings itself
        scaling["max_position_embeddings"] = max_position_embeddings
    return rope_theta, scaling
