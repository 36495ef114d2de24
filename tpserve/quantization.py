"""Which weight quantization a checkpoint carries, read from ``config.json``'s ``quantization_config``.

tpserve serves one quantized format, **int8 weight-only** (W8A16): per-output-channel
symmetric int8 weights with float scales, activations in the model dtype. It comes
from two places:

* ``--quantization int8`` on a float checkpoint: the ranks quantize every decoder
  linear layer while loading (worker/layers/int8_weights.py);
* a checkpoint already quantized in the `compressed-tensors
  <https://github.com/neuralmagic/compressed-tensors>`_ format (``quant_method:
  "compressed-tensors"``, ``format`` ``"int-quantized"`` or ``"naive-quantized"``):
  each quantized linear layer stores ``weight`` as int8 ``(N, K)`` and
  ``weight_scale`` as ``(N, 1)`` float (``dequantized = weight * weight_scale``; the
  library's ``NaiveQuantizationCompressor``), symmetric, so no zero point is stored.

Published FP8 and MXFP4 checkpoints (``quant_method`` ``"fp8"`` block-scaled,
compressed-tensors ``"float-quantized"``, ``"mxfp4"``: tpserve/weight_formats.py) are
dequantized by the ranks while loading; their layers are float (or int8 with
``--quantization int8``), so :func:`checkpoint_quantization` returns None for them.
``--quantization fp8`` keeps an FP8 checkpoint's linear weights as e4m3 instead (1 byte a
weight, converted in the matmul; its MoE experts are still dequantized at load).

And **int4 weight-only** (W4A16): 4-bit codes with a float scale and zero point per
group of input columns, from ``--quantization int4`` on a float checkpoint
(round-to-nearest, symmetric, groups of 128) or from a published 4-bit checkpoint
(:mod:`tpserve.quantization_int4` reads GPTQ, AWQ and compressed-tensors
``pack-quantized`` configs into an :class:`~tpserve.quantization_int4.Int4Format`).
Published 8-bit GPTQ and compressed-tensors ``pack-quantized`` W8A16 checkpoints are read
by the same code into the same layer kind (``"int4"``: packed codes, group-wise scales):
worker/layers/int8_groups.py says how their 8-bit codes are computed with.

Every other ``quantization_config`` (bitsandbytes, 3-bit GPTQ, 8-bit AWQ,
group-wise or asymmetric int8 compressed-tensors, activation or KV-cache quantization,
a quantized LM head) is refused at start-up, by the coordinator, before any rank
starts: :func:`checkpoint_quantization` raises ``ValueError`` naming what it found
and what is supported. No torch here: the coordinator reads this too.
"""

from __future__ import annotations

from typing import Any, Literal

from tpserve.quantization_int4 import layer_formats
from tpserve.weight_formats import compressed_tensors_groups, matches_target, weight_format

#: int8: weights per output channel, symmetric; int4: group-wise codes (tpserve/quantization_int4.py);
#: fp8: an FP8 checkpoint's e4m3 weights kept as stored (worker/layers/fp8_weights.py; only with an FP8
#: checkpoint). Activations stay in the model dtype.
Quantization = Literal["int8", "int4", "fp8"]
QUANTIZATION_METHODS: tuple[Quantization, ...] = ("int8", "int4", "fp8")
#: compressed-tensors formats that store ``weight`` as plain int8 plus ``weight_scale``.
COMPRESSED_TENSORS_FORMATS = ("int-quantized", "naive-quantized")
SUPPORTED = ("compressed-tensors int8 weight-only checkpoints (format int-quantized or naive-quantized: "
             "8-bit int weights, symmetric, strategy channel, no activation or KV-cache quantization, "
             "lm_head ignored), 4- or 8-bit GPTQ, 4-bit AWQ (GEMM) or 4- or 8-bit compressed-tensors pack-quantized "
             "checkpoints, "
             "block-scaled fp8 (quant_method fp8), compressed-tensors float-quantized fp8, mxfp4 (gpt-oss), "
             "or a float checkpoint with --quantization int8 or int4")


def checkpoint_quantization(raw_config: dict[str, Any]) -> Quantization | None:
    """The quantization a checkpoint's layers are served in: None (float), ``"int8"`` or ``"int4"``.

    None also for the FP8 / MXFP4 formats the ranks dequantize at load (their variant
    is checked here, by :func:`tpserve.weight_formats.weight_format`).

    Args:
        raw_config: the checkpoint's ``config.json`` as a dict.

    Raises:
        ValueError: a ``quantization_config`` other than compressed-tensors int8
            weight-only; the message names the offending key and value and what is
            supported.
    """
    qc = raw_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise _refuse(f"quantization_config is a {type(qc).__name__}, not a mapping")
    try:
        if weight_format(raw_config) is not None:
            return None  # dequantized to float while loading
    except ValueError as error:
        raise ValueError(f"{error}; tpserve serves {SUPPORTED}") from None
    method = qc.get("quant_method")
    if method in ("gptq", "awq") or (method == "compressed-tensors" and qc.get("format") == "pack-quantized"):
        layer_formats(qc)  # raises on a variant tpserve does not serve
        return "int4"
    if method != "compressed-tensors":
        raise _refuse(f"quantization_config quant_method={method!r}")
    fmt = qc.get("format")
    if fmt not in COMPRESSED_TENSORS_FORMATS:
        raise _refuse(f"compressed-tensors format={fmt!r}")
    groups = compressed_tensors_groups(qc, "int8", _refuse)
    ignore = list(qc.get("ignore") or [])
    for name, group in groups.items():
        _check_group(name, group, ignore)
    return "int8"


def served_quantization(raw_config: dict[str, Any], flag: str | None) -> str:
    """What ``ModelInfo.quantization`` and the start-up log lines report: the width of the decoder's
    quantized linear weights as served.

    ``""`` for float linear layers (a float checkpoint without ``flag``; an FP8 checkpoint dequantized at
    load; gpt-oss's MXFP4 checkpoint, whose routed experts, not linear layers, a CPU rank holds as 8-bit
    codes, said in its start-up line); ``"int8"``, ``"int4"`` or ``"fp8"`` for ``--quantization`` (``flag``) on a float or FP8
    checkpoint, for a compressed-tensors int8 checkpoint, and for a packed GPTQ / AWQ / compressed-tensors
    checkpoint by its codes' width: ``"int4"``, ``"int8"``, or ``"int4+int8"`` for a mixed-precision
    one (the loaders hold all of them as one layer kind, :data:`Quantization` ``"int4"``, so that kind
    alone would call an 8-bit GPTQ checkpoint 4-bit).

    Args:
        raw_config: the checkpoint's ``config.json`` as a dict (already accepted by
            :func:`checkpoint_quantization`).
        flag: ``--quantization`` as given, or None.
    """
    stored = checkpoint_quantization(raw_config)
    if stored != "int4":
        return stored or flag or ""
    bits = sorted({fmt.bits for fmt in layer_formats(raw_config["quantization_config"]).formats})
    return "+".join(f"int{b}" for b in bits)


def check_quantization_flag(raw_config: dict[str, Any], flag: str | None) -> None:
    """Refuse a ``--quantization`` value that does not apply to the checkpoint (the coordinator, before any
    rank starts; the ranks' loader asks again).

    A checkpoint stored quantized (compressed-tensors int8, GPTQ, AWQ, pack-quantized) is served as stored:
    a flag is accepted only where it says what is stored (``int4`` on a 4-bit one, ``int8`` on an 8-bit one,
    :func:`served_quantization`), so an 8-bit GPTQ checkpoint is not taken for the 4-bit one a flag asked for.
    ``fp8`` keeps an FP8 checkpoint's e4m3 weights: refused on any other checkpoint (MXFP4 included).

    Raises:
        ValueError: naming the flag and what the checkpoint stores.
    """
    if flag is None:
        return
    qc = raw_config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if checkpoint_quantization(raw_config) is not None:
        stored = served_quantization(raw_config, None)
        if flag != stored:
            raise ValueError(f"--quantization {flag} does not apply to this checkpoint: it is stored quantized "
                             f"({stored} weights, quantization_config quant_method {method!r}) and served as "
                             "stored; drop the flag")
        return
    fmt = weight_format(raw_config)
    if flag == "fp8" and fmt is not None and fmt.kind == "mxfp4":
        raise ValueError("--quantization fp8 keeps an FP8 checkpoint's weights as stored; this checkpoint is MXFP4 "
                         "(quantization_config quant_method mxfp4): drop the flag (its experts are held as 8-bit "
                         "codes on CPU ranks)")
    if flag == "fp8" and fmt is None:
        raise ValueError("--quantization fp8 keeps an FP8 checkpoint's weights as stored; this checkpoint is not "
                         "FP8 (quantization_config quant_method fp8 or compressed-tensors float-quantized): to "
                         "quantize its weights at load use --quantization int8 or int4, or drop the flag")


def _check_group(name: str, group: Any, ignore: list[str]) -> None:
    if not isinstance(group, dict):
        raise _refuse(f"config_groups.{name} is not a mapping")
    if group.get("format") not in (None, *COMPRESSED_TENSORS_FORMATS):
        raise _refuse(f"config_groups.{name}.format={group['format']!r}")
    for key in ("input_activations", "output_activations"):
        if group.get(key):
            raise _refuse(f"config_groups.{name}.{key}={group[key]!r} (activation quantization)")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise _refuse(f"config_groups.{name}.weights={weights!r}")
    expected = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    for key, value in expected.items():
        if weights.get(key) != value:
            raise _refuse(f"config_groups.{name}.weights.{key}={weights.get(key)!r} (expected {value!r})")
    for key in ("group_size", "block_structure", "actorder"):
        if weights.get(key) is not None:
            raise _refuse(f"config_groups.{name}.weights.{key}={weights[key]!r}")
    if weights.get("dynamic"):
        raise _refuse(f"config_groups.{name}.weights.dynamic={weights['dynamic']!r}")
    targets = list(group.get("targets") or [])
    if matches_target(targets, "lm_head", "Linear") and not matches_target(ignore, "lm_head", None):
        # A quantized lm_head is refused here; the head of an accepted checkpoint is served as stored, float
        # (docs/design/models.md, "The LM head in int8": only the ranks' own quantization rounds a head).
        raise _refuse(f"config_groups.{name} quantizes lm_head (targets={targets}, ignore={ignore})")



def _refuse(found: str) -> ValueError:
    return ValueError(f"unsupported quantized checkpoint: {found}; tpserve serves {SUPPORTED}")
