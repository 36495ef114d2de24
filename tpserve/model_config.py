"""What a model *is*, parsed from its Hugging Face ``config.json``.

Both sides of the worker group read this module: the coordinator sizes its KV
block pool and checks tensor-parallel divisibility before starting any worker;
each worker builds its model shard from it. It therefore imports no torch.

Supported architectures (all "Llama family": RMSNorm, RoPE, SwiGLU MLP, GQA):

| model_type | q/k/v bias            | o_proj bias           | refused                              |
| ---------- | --------------------- | --------------------- | ------------------------------------ |
| llama      | ``attention_bias``    | ``attention_bias``    | -                                    |
| mistral    | no                    | no                    | ``sliding_window`` < max positions   |
| qwen2      | always                | no                    | ``use_sliding_window: true``         |

RoPE parameters are read from the ``transformers`` 5 layout (``rope_parameters``
holding ``rope_theta``) or the older one (top-level ``rope_theta`` plus
``rope_scaling``); both normalise to ``rope_theta`` and ``rope_scaling``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpserve.quantization import Quantization, checkpoint_quantization

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a Llama-family checkpoint.

    Attributes:
        model_type: ``"llama"``, ``"mistral"`` or ``"qwen2"``.
        architectures: class names from the config (informative only).
        vocab_size: number of token ids (rows of the embedding), unpadded.
        hidden_size: width of the residual stream.
        intermediate_size: width of the MLP (gate/up output).
        num_hidden_layers: number of decoder layers.
        total_num_heads: query heads of the whole model (``num_attention_heads``).
        total_num_kv_heads: key/value heads of the whole model (``num_key_value_heads``).
        head_dim: size of one attention head (explicit ``head_dim`` or hidden/heads).
        rms_norm_eps: epsilon inside RMSNorm's square root.
        rope_theta: RoPE base wavelength (Su et al. 2021, arXiv:2104.09864).
        rope_scaling: ``None`` for plain RoPE, else a dict with ``rope_type``
            ``"linear"`` (``factor``), ``"llama3"`` (``factor``,
            ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``), ``"yarn"`` (``factor``,
            ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``,
            ``truncate``, ``attention_factor``, ``mscale``, ``mscale_all_dim``; the
            last three may be None) or ``"dynamic"`` (``factor``,
            ``max_position_embeddings``); worker/layers/rotary.py has the formulas.
        max_position_embeddings: longest sequence the model was built for, in tokens.
        tie_word_embeddings: the LM head reuses the input embedding matrix.
        attention_bias: q_proj, k_proj and v_proj carry a bias.
        o_proj_bias: o_proj carries a bias.
        mlp_bias: gate_proj, up_proj and down_proj carry a bias.
        bos_token_id: beginning-of-sequence id, or None.
        eos_token_ids: end-of-sequence ids (may be empty).
        torch_dtype: the checkpoint's dtype name (``"float32"``, ``"bfloat16"``...), or None.
        quantization: how the checkpoint's linear weights are stored: None (float) or
            ``"int8"`` (compressed-tensors int8 weight-only; :mod:`tpserve.quantization`).
    """

    model_type: str
    architectures: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    total_num_heads: int
    total_num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    quantization: Quantization | None = None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``<model_dir>/config.json``.

        Raises:
            FileNotFoundError: no ``config.json`` in ``model_dir``.
            ValueError: unsupported model type, activation, RoPE type, sliding
                window or quantization_config; a required key is missing.
        """
        path = Path(model_dir) / "config.json"
        with path.open(encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a ``config.json`` already loaded as a dict; see :meth:`from_pretrained`."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        _check_no_sliding_window(raw, model_type)
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported; expected 'silu'")

        hidden_size = _required(raw, "hidden_size")
        total_num_heads = _required(raw, "num_attention_heads")
        head_dim = raw.get("head_dim") or hidden_size // total_num_heads
        max_position_embeddings = _required(raw, "max_position_embeddings")
        rope_theta, rope_scaling = _parse_rope(raw, max_position_embeddings)
        if model_type == "qwen2":
            attention_bias, o_proj_bias = True, False
        elif model_type == "llama":
            attention_bias = o_proj_bias = bool(raw.get("attention_bias", False))
        else:
            attention_bias = o_proj_bias = False
        eos = raw.get("eos_token_id")
        eos_token_ids = () if eos is None else tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)
        return cls(
            model_type=model_type,
            architectures=tuple(raw.get("architectures") or ()),
            vocab_size=_required(raw, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_required(raw, "intermediate_size"),
            num_hidden_layers=_required(raw, "num_hidden_layers"),
            total_num_heads=total_num_heads,
            total_num_kv_heads=raw.get("num_key_value_heads") or total_num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=model_type == "llama" and bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            quantization=checkpoint_quantization(raw),
        )

    def check_tensor_parallel(self, tp: int) -> None:
        """Refuse a tensor-parallel degree this model cannot be split into.

        Query heads and the MLP width are split evenly across ranks; KV heads are
        split when ``tp <= total_num_kv_heads`` and replicated (each rank keeps one
        head, shared by ``tp // total_num_kv_heads`` ranks) when it is larger. The
        vocabulary is padded to a multiple of ``tp``, so it need not divide.

        Raises:
            ValueError: naming the dimension that does not divide, e.g.
                ``"intermediate_size=172 is not divisible by tensor_parallel_size=8"``.
        """
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        for name, size in (
            ("num_attention_heads", self.total_num_heads),
            ("intermediate_size", self.intermediate_size),
        ):
            if size % tp:
                raise ValueError(f"{name}={size} is not divisible by tensor_parallel_size={tp}")
        kv = self.total_num_kv_heads
        if tp <= kv and kv % tp:
            raise ValueError(f"num_key_value_heads={kv} is not divisible by tensor_parallel_size={tp}")
        if tp > kv and tp % kv:
            raise ValueError(
                f"tensor_parallel_size={tp} is larger than num_key_value_heads={kv} but not a "
                f"multiple of it, so the key/value heads cannot be replicated evenly"
            )

    @property
    def max_model_len(self) -> int:
        """The longest sequence this model serves, in tokens: ``max_position_embeddings``, extended
        by RoPE scaling that extrapolates past it (vLLM's rule): ``"dynamic"`` to
        ``max_position_embeddings * factor``, ``"yarn"`` to ``original_max_position_embeddings * factor``
        (when longer)."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") == "dynamic":
            return int(self.max_position_embeddings * scaling["factor"])
        if scaling.get("rope_type") == "yarn":
            return max(self.max_position_embeddings,
                       int(scaling["original_max_position_embeddings"] * scaling["factor"]))
        return self.max_position_embeddings

    def num_kv_heads_per_rank(self, tp: int) -> int:
        """Key/value heads each rank stores: ``total_num_kv_heads / tp``, at least 1."""
        return max(1, self.total_num_kv_heads // tp)

    def padded_vocab_size(self, tp: int) -> int:
        """``vocab_size`` rounded up to a multiple of ``tp`` (rows of the sharded embedding)."""
        return -(-self.vocab_size // tp) * tp

    def kv_cache_bytes_per_token(self, tp: int, dtype_size: int) -> int:
        """Bytes of KV cache one token takes on one rank, all layers, K and V.

        ``2 * num_hidden_layers * num_kv_heads_per_rank(tp) * head_dim * dtype_size``.

        Args:
            tp: tensor-parallel degree.
            dtype_size: bytes per cache element (4 for float32, 2 for bfloat16/float16).
        """
        return 2 * self.num_hidden_layers * self.num_kv_heads_per_rank(tp) * self.head_dim * dtype_size


def _required(raw: dict[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ValueError(f"config.json has no {key!r}")
    return raw[key]


def _check_no_sliding_window(raw: dict[str, Any], model_type: str) -> None:
    # Sliding-window attention would need a different mask and cache eviction;
    # serving such a model with full attention would silently change its output.
    if model_type == "qwen2" and raw.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True (qwen2) is not supported: no sliding-window attention")
    window = raw.get("sliding_window")
    max_pos = raw.get("max_position_embeddings")
    if model_type == "mistral" and window is not None and max_pos is not None and window < max_pos:
        raise ValueError(
            f"sliding_window={window} < max_position_embeddings={max_pos} is not supported: "
            "no sliding-window attention"
        )


def _parse_rope(raw: dict[str, Any], max_position_embeddings: int) -> tuple[float, dict[str, Any] | None]:
    """Return ``(rope_theta, rope_scaling)`` from either config layout.

    ``original_max_position_embeddings`` follows ``transformers``'
    ``PreTrainedConfig.standardize_rope_params``: a top-level key wins, then the
    RoPE dict's, then ``max_position_embeddings``.
    """
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling rope_type={rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported")
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
        scaling["beta_fast"] = float(params.get("beta_fast") or 32)
        scaling["beta_slow"] = float(params.get("beta_slow") or 1)
        scaling["truncate"] = bool(params.get("truncate", True))
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            scaling[key] = None if params.get(key) is None else float(params[key])
    elif rope_type == "dynamic":  # transformers scales against max_position_embeddings itself
        scaling["max_position_embeddings"] = max_position_embeddings
    return rope_theta, scaling
