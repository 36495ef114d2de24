"""What a model *is*, parsed from its Hugging Face ``config.json``.

Both sides of the worker group read this module: the coordinator sizes its KV
block pool and checks tensor-parallel divisibility before starting any worker;
each worker builds its model shard from it. It therefore imports no torch.

:class:`ModelConfig` holds what every family shares (sizes, heads, RoPE, the
facts that size the KV cache) under standard Hugging Face keys, plus the raw
dict (``hf_config``): a family's model class (worker/models/) reads its own keys
from it with :meth:`ModelConfig.hf_value`. The architecture must be one of
tpserve/model_registry.py's, which the coordinator checks here, at start-up.

RoPE parameters are read from the ``transformers`` 5 layout (``rope_parameters``
holding ``rope_theta``) or the older one (top-level ``rope_theta`` plus
``rope_scaling``); both normalise to ``rope_theta`` and ``rope_scaling``.

``sliding_window`` and ``layer_types`` say which layers attend over a sliding
window (:meth:`ModelConfig.layer_sliding_window`); RoPE parameters nested by layer
type (Gemma 3's local and global bases) are kept per type
(:meth:`ModelConfig.layer_rope`).

What one token's KV cache holds is a property of the config (:meth:`ModelConfig.kv_cache_spec`):
per-head keys and values for grouped-query attention, or one latent and one shared RoPE key
for multi-head latent attention (DeepSeek V2/V3, Kimi K2); the coordinator's block budget,
every rank's cache and ``GetModelInfo``'s KV-token count are sized from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tpserve.hybrid_layers import (default_hybrid_layer_types, hybrid_layer_types, hybrid_num_layers,
                                   state_layer_types, stateless_layer_types)
from tpserve.model_config_rules import check_config
from tpserve.model_registry import (LATENT_ATTENTION_ARCHITECTURES, LINEAR_ATTENTION_ARCHITECTURES, NEVER_TIED,
                                    PARTIAL_ROTARY_DEFAULTS, SLIDING_WINDOW_RULES, resolve_architecture,
                                    ties_word_embeddings_by_default)
from tpserve.quantization import Quantization, checkpoint_quantization
from tpserve.rope_config import config_value, parse_layer_rope, parse_rope, rope_dict

LAYER_TYPES = ("full_attention", "sliding_attention")
#: Llama 4's chunked local attention (``attention_chunk_size``): a layer type only the families
#: that read it accept; anywhere else it would be served as full attention, so it is refused.
CHUNKED_ATTENTION = "chunked_attention"
CHUNKED_ATTENTION_ARCHITECTURES = frozenset({"Llama4ForCausalLM"})


_T = TypeVar("_T")


@dataclass(frozen=True)
class KVCacheSpec:
    """What one decoder layer's paged cache holds per token on one rank: two tensors, each ``(heads, width)``.

    Attributes:
        kind: ``"per_head"``: keys and values of this rank's KV heads, ``first = second =
            (num_kv_heads_per_rank, head_dim)``; ``"latent"`` (multi-head latent attention):
            ``first = (1, kv_lora_rank)`` the normalised compressed latent, ``second = (1,
            qk_rope_head_dim)`` the rotated key shared by every head, not split by tensor
            parallelism (every rank holds the whole of both).
        first, second: ``(heads, width)`` of the layer's two cache tensors, elements.
    """

    kind: str
    first: tuple[int, int]
    second: tuple[int, int]

    @property
    def elements_per_token(self) -> int:
        """Cache elements one token takes in one layer: ``2 * heads * head_dim``, or ``kv_lora_rank + rope dim``."""
        return self.first[0] * self.first[1] + self.second[0] * self.second[1]


#: Files older quantizers wrote beside ``config.json`` instead of its ``quantization_config``, and the
#: ``quant_method`` each implies where the file does not say (vLLM reads the same files).
LEGACY_QUANTIZATION_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))


def legacy_quantization_config(model_dir: Path) -> dict[str, Any] | None:
    """The quantization settings an older AutoGPTQ (``quantize_config.json``) or AutoAWQ (``quant_config.json``)
    checkpoint keeps in a file of their own, as a ``quantization_config`` (its ``quant_method`` filled in where
    absent); None when there is neither.

    Raises:
        ValueError: the file is not a JSON object (names it).
    """
    for name, method in LEGACY_QUANTIZATION_FILES:
        path = model_dir / name
        if path.is_file():
            try:
                settings = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"{path}: cannot read the quantization settings ({exc})") from None
            if not isinstance(settings, dict):
                raise ValueError(f"{path}: the quantization settings are a {type(settings).__name__}, not an object")
            return {"quant_method": method, **settings}
    return None


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters every served family shares, and the raw config.

    Attributes:
        architecture: the served ``architectures`` name (a key of
            :data:`tpserve.model_registry.MODEL_REGISTRY`), e.g. ``"LlamaForCausalLM"``.
        model_type: ``config.json``'s ``model_type`` (``"llama"``, ``"qwen2"``...), informative.
        architectures: class names from the config.
        vocab_size: number of token ids (rows of the embedding), unpadded.
        hidden_size: width of the residual stream.
        intermediate_size: width of the MLP (gate/up output).
        num_hidden_layers: number of decoder layers.
        total_num_heads: query heads of the whole model (``num_attention_heads``).
        total_num_kv_heads: key/value heads of the whole model (``num_key_value_heads``).
        head_dim: size of one attention head (explicit ``head_dim`` or hidden/heads).
        rotary_dim: None when RoPE rotates whole heads; else (the partial-RoPE families of
            :data:`tpserve.model_registry.PARTIAL_ROTARY_DEFAULTS`) how many leading dimensions
            of each query and key head it rotates, ``int(head_dim * partial_rotary_factor)``
            (or MiniMax-M2's ``rotary_dim``), even and below ``head_dim``.
        hidden_act: the MLP's activation name (``hidden_act``; each family checks it).
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
        sliding_window: tokens a sliding-window layer attends to (itself included), or
            None when no layer slides (absent, ``use_sliding_window: false``, or not
            shorter than ``max_position_embeddings``).
        layer_types: per layer, ``"full_attention"`` or ``"sliding_attention"`` (or a hybrid's state kind, ``"conv"``...)
            (``layer_types`` of the config; else Qwen2's rule, layers from
            ``max_window_layers`` on slide when ``use_sliding_window``; else every
            layer alike). A family whose config class derives another default
            (Gemma's alternation) reads ``hf_config`` itself when the key is absent.
        layer_rope_parameters: ``{layer type: (rope_theta, rope_scaling)}`` when the config
            nests its RoPE parameters by layer type (``rope_parameters:
            {"full_attention": {...}, "sliding_attention": {...}}``), else empty;
            ``rope_theta``/``rope_scaling`` are then the full-attention layers'.
        tie_word_embeddings: the LM head reuses the input embedding matrix (absent from the config:
            the family's ``transformers`` default, :func:`tpserve.model_registry.ties_word_embeddings_by_default`).
            False means the checkpoint must hold ``lm_head.weight`` (worker/loader.py, launch/startup.py).
        bos_token_id: beginning-of-sequence id, or None.
        eos_token_ids: end-of-sequence ids (may be empty).
        torch_dtype: the checkpoint's dtype name (``"float32"``, ``"bfloat16"``...), or None.
        quantization: how the checkpoint's linear weights are stored: None (float),
            ``"int8"`` (compressed-tensors int8 weight-only) or ``"int4"`` (GPTQ, AWQ,
            compressed-tensors W4A16; :mod:`tpserve.quantization`).
        hf_config: the whole ``config.json`` dict, for family-specific keys
            (read them with :meth:`hf_value`). Not to be mutated.
    """

    architecture: str
    model_type: str | None
    architectures: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    total_num_heads: int
    total_num_kv_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    sliding_window: int | None
    layer_types: tuple[str, ...]
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    quantization: Quantization | None = None
    layer_rope_parameters: dict[str, tuple[float, dict[str, Any] | None]] = field(default_factory=dict)
    rotary_dim: int | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``<model_dir>/config.json``.

        Raises:
            FileNotFoundError: no ``config.json`` in ``model_dir``.
            ValueError: unsupported architecture, RoPE type, sliding window, layer
                type or quantization_config; a required key is missing; a value out of
                its range (tpserve/model_config_rules.py: one line naming the field and value).
        """
        path = Path(model_dir) / "config.json"
        with path.open(encoding="utf-8") as f:
            raw = json.load(f)
        if isinstance(raw, dict) and "quantization_config" not in raw:
            legacy = legacy_quantization_config(Path(model_dir))
            if legacy is not None:
                raw["quantization_config"] = legacy
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a ``config.json`` already loaded as a dict; see :meth:`from_pretrained`."""
        architectures = tuple(raw.get("architectures") or ())
        architecture = resolve_architecture(architectures)
        check_config(raw, architecture)  # nonsense values refused before anything is computed from them
        hidden_size = _required(raw, "hidden_size")
        total_num_heads = _required(raw, "num_attention_heads")
        num_hidden_layers = hybrid_num_layers(raw, architecture) or _required(raw, "num_hidden_layers")
        head_dim = config_value(raw, "head_dim", hidden_size // total_num_heads)
        if architecture in LATENT_ATTENTION_ARCHITECTURES:  # RoPE turns the decoupled key only (Hub configs lack head_dim)
            head_dim = config_value(raw, "qk_rope_head_dim", 64)
        max_position_embeddings = _required(raw, "max_position_embeddings")
        layer_rope = parse_layer_rope(raw, max_position_embeddings, LAYER_TYPES)
        if layer_rope:
            rope_theta, rope_scaling = layer_rope.get("full_attention") or next(iter(layer_rope.values()))
        else:
            rope_theta, rope_scaling = parse_rope(raw, max_position_embeddings)
        sliding_window, layer_types = _parse_attention_windows(raw, num_hidden_layers, max_position_embeddings,
                                                               chunked=architecture in CHUNKED_ATTENTION_ARCHITECTURES,
                                                               architecture=architecture)
        eos = raw.get("eos_token_id")
        eos_token_ids = () if eos is None else tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)
        return cls(
            architecture=architecture,
            model_type=raw.get("model_type"),
            architectures=architectures,
            vocab_size=_required(raw, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_required(raw, "intermediate_size"),
            num_hidden_layers=num_hidden_layers,
            total_num_heads=total_num_heads,
            # Latent attention has no key/value heads of its own (DeepseekV3Config writes 128 whatever the
            # query heads): every query head reads the shared latent, so the count is the query heads'.
            total_num_kv_heads=(total_num_heads if architecture in LATENT_ATTENTION_ARCHITECTURES
                                else config_value(raw, "num_key_value_heads", total_num_heads)),
            head_dim=head_dim,
            hidden_act=str(raw.get("hidden_act", "silu")),
            rms_norm_eps=float(config_value(raw, "rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position_embeddings,
            sliding_window=sliding_window,
            layer_types=layer_types,
            tie_word_embeddings=architecture not in NEVER_TIED and bool(
                config_value(raw, "tie_word_embeddings", ties_word_embeddings_by_default(architecture))),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            quantization=checkpoint_quantization(raw),
            layer_rope_parameters=layer_rope,
            rotary_dim=_parse_rotary_dim(raw, architecture, head_dim),
            hf_config=raw,
        )

    def hf_value(self, key: str, default: _T, kind: type[_T] | tuple[type, ...] | None = None) -> _T:
        """A family-specific key of ``config.json`` (``default`` when absent or null), type-checked.

        Args:
            key: the config key, e.g. ``"attention_bias"``.
            default: the value ``transformers`` assumes when the key is absent.
            kind: the type(s) the value must have; default ``type(default)`` (no check
                when ``default`` is None too). ``bool`` accepts only booleans; ``float``
                accepts integers too.

        Raises:
            ValueError: the value has another type; the message names the key.
        """
        value = self.hf_config.get(key)
        if value is None or (kind is None and default is None):
            return default if value is None else value
        kinds = kind if isinstance(kind, tuple) else (kind or type(default),)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            return float(value)  # type: ignore[return-value]
        ok = isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))
        if not ok:
            names = " or ".join(k.__name__ for k in kinds)
            raise ValueError(f"config.json {key}={value!r} must be of type {names}")
        return value

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
        # Gated DeltaNet heads (hybrid families), with transformers' defaults when absent.
        for name, default in (("linear_num_key_heads", 16), ("linear_num_value_heads", 32)):
            heads = self.hf_config.get(name, default) if self.architecture in LINEAR_ATTENTION_ARCHITECTURES else None
            if isinstance(heads, int) and heads % tp:
                raise ValueError(f"{name}={heads} is not divisible by tensor_parallel_size={tp}")
        kv = self.total_num_kv_heads
        if tp <= kv and kv % tp:
            raise ValueError(f"num_key_value_heads={kv} is not divisible by tensor_parallel_size={tp}")
        if tp > kv and tp % kv:
            raise ValueError(
                f"tensor_parallel_size={tp} is larger than num_key_value_heads={kv} but not a "
                f"multiple of it, so the key/value heads cannot be replicated evenly"
            )

    def layer_sliding_window(self, layer_index: int) -> int | None:
        """The window of layer ``layer_index`` in tokens (itself included), or None for full attention.

        A layer slides when its ``layer_types`` entry is ``"sliding_attention"`` and the
        model has a ``sliding_window`` (``transformers``: ``config.sliding_window if
        layer_type == "sliding_attention" else None``).
        """
        return self.sliding_window if self.layer_types[layer_index] == "sliding_attention" else None

    def layer_rope(self, layer_type: str) -> tuple[float, dict[str, Any] | None]:
        """``(rope_theta, rope_scaling)`` of the layers of ``layer_type``: their nested entry, else the model's."""
        return self.layer_rope_parameters.get(layer_type, (self.rope_theta, self.rope_scaling))

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

    @property
    def state_layer_indices(self) -> tuple[int, ...]:
        """The layers with a per-sequence state instead of a KV cache (hybrids; tpserve/hybrid_layers.py)."""
        kinds = state_layer_types(self.architecture)
        return tuple(i for i, kind in enumerate(self.layer_types) if kind in kinds)

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache: every layer but the state layers (and Nemotron-H's MLP / MoE blocks)."""
        kinds = state_layer_types(self.architecture) | stateless_layer_types(self.architecture)
        return sum(1 for kind in self.layer_types if kind not in kinds)

    def num_kv_heads_per_rank(self, tp: int) -> int:
        """Key/value heads each rank stores: ``total_num_kv_heads / tp``, at least 1."""
        return max(1, self.total_num_kv_heads // tp)

    def padded_vocab_size(self, tp: int) -> int:
        """``vocab_size`` rounded up to a multiple of ``tp`` (rows of the sharded embedding)."""
        return -(-self.vocab_size // tp) * tp

    @property
    def latent_attention(self) -> bool:
        """Whether the model's attention is multi-head latent attention (its cache holds latents)."""
        return self.architecture in LATENT_ATTENTION_ARCHITECTURES

    def kv_cache_spec(self, tp: int) -> KVCacheSpec:
        """One layer's cache per token on one rank of a ``tp``-way group (see :class:`KVCacheSpec`).

        Multi-head latent attention: ``kv_lora_rank + qk_rope_head_dim`` elements (576 for
        DeepSeek V3), at every ``tp``; else ``2 * num_kv_heads_per_rank(tp) * head_dim``.
        """
        if self.latent_attention:
            return KVCacheSpec("latent", (1, int(self.hf_config["kv_lora_rank"])),
                               (1, int(self.hf_config["qk_rope_head_dim"])))
        heads = (self.num_kv_heads_per_rank(tp), self.head_dim)
        return KVCacheSpec("per_head", heads, heads)

    def kv_cache_bytes_per_token(self, tp: int, dtype_size: int) -> int:
        """Bytes of KV cache one token takes on one rank, all layers.

        ``num_attention_layers * kv_cache_spec(tp).elements_per_token * dtype_size``: with per-head
        caching ``2 * num_hidden_layers * num_kv_heads_per_rank(tp) * head_dim * dtype_size`` (K and V),
        with latent attention ``num_hidden_layers * (kv_lora_rank + qk_rope_head_dim) * dtype_size``.

        Args:
            tp: tensor-parallel degree.
            dtype_size: bytes per cache element (4 for float32, 2 for bfloat16/float16).
        """
        return self.num_attention_layers * self.kv_cache_spec(tp).elements_per_token * dtype_size


def _required(raw: dict[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ValueError(f"config.json has no {key!r}")
    return raw[key]


def _parse_attention_windows(
    raw: dict[str, Any], num_hidden_layers: int, max_position_embeddings: int, *, chunked: bool = False,
    architecture: str = "",
) -> tuple[int | None, tuple[str, ...]]:
    """``(sliding_window, layer_types)`` from the standard keys; see :class:`ModelConfig`.

    The window is read only by the families of :data:`~tpserve.model_registry.SLIDING_WINDOW_RULES`, and on the
    layers their rule names, as ``transformers`` does: a ``sliding_window`` key in another family's config
    (DeepSeek V3, GLM-4.5, MiniMax-M2 ...) is ignored, as their attention ignores it. ``chunked``: the family
    accepts :data:`CHUNKED_ATTENTION` layers too; a hybrid ``architecture`` its state layer kinds
    (tpserve/hybrid_layers.py).

    Raises:
        ValueError: a malformed ``layer_types``, ``sliding_window`` or ``no_rope_layers``.
    """
    rule, default_window = SLIDING_WINDOW_RULES.get(architecture, (None, None))
    window = raw.get("sliding_window", default_window)
    gated = rule in ("qwen2", "qwen2_moe", "qwen3_moe", "smollm3")  # the window needs use_sliding_window
    if rule is None or (gated and not raw.get("use_sliding_window")) \
            or (window is not None and window >= max_position_embeddings):
        window = None  # none read, switched off, or covering every position: full attention
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"config.json sliding_window={window!r} must be a positive integer")
    layer_types = hybrid_layer_types(raw, architecture) or (
        raw.get("layer_types") if rule not in ("all", "qwen3_moe") else None) or _window_layer_types(
        raw, rule, window, num_hidden_layers) or default_hybrid_layer_types(raw, architecture, num_hidden_layers)
    if layer_types is None:
        layer_types = ["sliding_attention" if window is not None else "full_attention"] * num_hidden_layers
    if not isinstance(layer_types, list) or len(layer_types) != num_hidden_layers:
        named = next((key for key in ("layer_types", "layers_block_type", "hybrid_override_pattern") if key in raw),
                     "layer_types")
        raise ValueError(f"config.json {named} must give one type per layer (num_hidden_layers={num_hidden_layers}), "
                         f"got {len(layer_types) if isinstance(layer_types, (list, str)) else repr(layer_types)}")
    if window is None:  # a sliding layer without a window attends to everything (transformers' sliding_window None)
        layer_types = ["full_attention" if t == "sliding_attention" else t for t in layer_types]
    hybrid = state_layer_types(architecture) | stateless_layer_types(architecture)
    known = LAYER_TYPES + ((CHUNKED_ATTENTION,) if chunked else ()) + tuple(sorted(hybrid))
    unknown = sorted({t for t in layer_types if t not in known})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported; expected {known}")
    if hybrid and all(t in hybrid for t in layer_types):  # sized by KV bytes per block: none without attention
        named = next((key for key in ("hybrid_override_pattern", "layers_block_type", "layer_types") if key in raw),
                     "layer_types")
        raise ValueError(f"config.json {named} has no attention layer ({len(layer_types)} layers, of "
                         f"{', '.join(sorted(set(layer_types)))}): a model without attention layers is not "
                         "supported; tpserve serves hybrids with at least one")
    return window, tuple(layer_types)


def _window_layer_types(raw: dict[str, Any], rule: str | None, window: int | None,
                        num_hidden_layers: int) -> list[str] | None:
    """The sliding layers of a Qwen, SmolLM3 or alternating rule (:data:`~tpserve.model_registry.SLIDING_WINDOW_RULES`),
    as their ``transformers`` configs derive ``layer_types``; None for the other rules or without a window.

    Raises:
        ValueError: SmolLM3's ``no_rope_layers`` is not one 0 or 1 per layer.
    """
    if window is None or rule not in ("qwen2", "qwen2_moe", "smollm3", "alternate"):
        return None
    first = raw.get("max_window_layers", 28)  # Qwen2Config's default
    if rule == "alternate":
        slides = [i % 2 == 0 for i in range(num_hidden_layers)]
    elif rule == "qwen2":
        slides = [i >= first for i in range(num_hidden_layers)]
    elif rule == "qwen2_moe":
        slides = [(i + 1) % 2 == 1 and i < first for i in range(num_hidden_layers)]
    else:
        interval = raw.get("no_rope_layer_interval", 4)
        no_rope = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_hidden_layers)]
        if not isinstance(no_rope, list) or len(no_rope) != num_hidden_layers:
            raise ValueError(f"config.json no_rope_layers must give one 0 or 1 per layer ({num_hidden_layers})")
        slides = [not uses_rope for uses_rope in no_rope]
    return ["sliding_attention" if slide else "full_attention" for slide in slides]


def _parse_rotary_dim(raw: dict[str, Any], architecture: str, head_dim: int) -> int | None:
    """How many leading dimensions of a head RoPE rotates, as ``transformers`` computes it.

    ``partial_rotary_factor`` from the RoPE dict, else the top level (Phi style), else
    MiniMax-M2's ``rotary_dim / head_dim``, else the family's default; the dimension is
    ``int(head_dim * factor)``, as ``transformers``' default RoPE initialisation takes it;
    None when that is the whole head.

    Raises:
        ValueError: a factor below 1 for a family without partial RoPE, or an odd dimension.
    """
    params = rope_dict(raw) or {}
    nested = [p for p in params.values() if isinstance(p, dict)] if isinstance(params, dict) else []
    if any(p.get("partial_rotary_factor", 1.0) != 1.0 for p in nested):
        raise ValueError("partial_rotary_factor per layer type is not supported")
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if factor is None:
        factor = raw.get("partial_rotary_factor")
    if factor is None and raw.get("rotary_dim") is not None and architecture in PARTIAL_ROTARY_DEFAULTS:
        factor = raw["rotary_dim"] / head_dim
    if factor is None:
        factor = PARTIAL_ROTARY_DEFAULTS.get(architecture, 1.0)
    if factor != 1.0 and architecture not in PARTIAL_ROTARY_DEFAULTS:
        raise ValueError(f"partial_rotary_factor={factor} is not supported by {architecture} "
                         f"(partial RoPE: {', '.join(sorted(PARTIAL_ROTARY_DEFAULTS))})")
    rotary_dim = int(head_dim * factor)
    if rotary_dim == head_dim:
        return None
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor={factor} gives rotary_dim={rotary_dim} of head_dim={head_dim}; "
                         "RoPE rotates pairs, so it must be a positive even number")
    return rotary_dim
