"""Published low-bit weight formats that the ranks dequantize while loading: FP8 and MXFP4.

Three ``quantization_config`` families are read here (no torch: the coordinator checks
them before any rank starts; worker/dequantize.py does the arithmetic):

* **block-scaled FP8** (``quant_method: "fp8"``; DeepSeek V3 / R1, Kimi K2, Qwen3-FP8;
  transformers' ``FineGrainedFP8Config``): a quantized linear layer stores ``weight`` as
  ``float8_e4m3fn`` ``(N, K)`` and ``weight_scale_inv`` float32 ``(ceil(N / bn), ceil(K / bk))`` for
  ``weight_block_size: [bn, bk]`` (``[128, 128]`` as published); ``w[n, k] = weight[n, k] *
  weight_scale_inv[n // bn, k // bk]``. ``activation_scheme`` must be ``dynamic`` (activations
  are not quantized by a stored scale; tpserve keeps them in the model dtype).
* **compressed-tensors FP8** (``quant_method: "compressed-tensors"``, ``format:
  "float-quantized"``; llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK schemes): ``weight``
  ``float8_e4m3fn`` and ``weight_scale`` per tensor ``(1,)``, per output channel ``(N, 1)`` or
  per block ``(N / bn, K / bk)``; ``w = weight * weight_scale``. Dynamic input activations
  are accepted (served unquantized); static ones are refused.
* **MXFP4** (``quant_method: "mxfp4"``; gpt-oss's release checkpoints, OCP Microscaling
  spec v1.0): a stacked expert weight ``<name>`` of float shape ``(E, A, B)`` is stored as
  ``<name>_blocks`` uint8 ``(E, B, A / 32, 16)`` (two e2m1 values a byte, low nibble first)
  and ``<name>_scales`` uint8 ``(E, B, A / 32)`` (e8m0: ``2 ** (s - 127)`` per 32 values);
  transformers' ``integrations/mxfp4.py`` (``convert_moe_packed_tensors``) is the reference.

``modules_to_not_convert`` / ``ignore`` need no interpretation: a layer the config leaves
out is stored in float and loaded as it is, and a float8 or ``_blocks`` tensor is
dequantized whatever its name; a quantized tensor without its scale is refused at load.
"""

from __future__ import annotations

from dataclasses import dataclass
import re
from collections.abc import Callable
from typing import Any, Literal

#: How the ranks treat a tensor: fp8 with a per-block inverse scale, fp8 with a compressed-tensors scale, mxfp4.
FormatKind = Literal["fp8_block", "fp8_compressed_tensors", "mxfp4"]
#: Size of an MXFP4 scale group (values per e8m0 scale), and bytes of packed values per group.
MXFP4_GROUP = 32
MXFP4_GROUP_BYTES = 16


@dataclass(frozen=True)
class WeightFormat:
    """A checkpoint format the ranks dequantize while loading.

    Attributes:
        kind: which format.
        scale_suffix: the scale tensor's name after ``weight`` (``"_scale_inv"`` or ``"_scale"``)
            for FP8; unused for MXFP4.
        block: ``(rows, columns)`` of one FP8 scale block when the scales are per block, else None
            (compressed-tensors per-tensor or per-channel scales).
        description: the format in words, for the start-up log line.
    """

    kind: FormatKind
    scale_suffix: str
    block: tuple[int, int] | None
    description: str


def weight_format(raw_config: dict[str, Any]) -> WeightFormat | None:
    """The dequantize-at-load format of a checkpoint, or None when it is not one of them.

    Args:
        raw_config: the checkpoint's ``config.json`` as a dict.

    Raises:
        ValueError: an FP8 / MXFP4 variant that is not served; the message names the field
            and value (``quantization_config.activation_scheme='static'``, an ``fmt`` other than
            ``e4m3``, a malformed ``weight_block_size``, ...).
    """
    qc = raw_config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _block_fp8(qc)
    if method == "mxfp4":
        _check_module_list(qc, "modules_to_not_convert")
        return WeightFormat("mxfp4", "", None, "mxfp4 experts (e2m1 with e8m0 scales per 32)")
    if method == "compressed-tensors" and qc.get("format") == "float-quantized":
        return _compressed_tensors_fp8(qc)
    return None


def compressed_tensors_groups(qc: dict[str, Any], stored_as: str,
                              refuse: Callable[[str], ValueError]) -> dict[str, Any]:
    """A compressed-tensors config's ``config_groups``, after the checks every scheme we serve shares.

    Args:
        qc: ``quantization_config``.
        stored_as: what the weights must be stored as (``"fp8"``, ``"int8"``), for the message.
        refuse: builds the caller's one-line error from what was found.

    Raises:
        ValueError: (from ``refuse``) weights not stored compressed, a sparsity or transform scheme, a
            ``kv_cache_scheme`` that is not a mapping, or no ``config_groups``. A ``kv_cache_scheme``
            (llm-compressor's static per-tensor FP8 KV scales) is accepted: the checkpoint's ``k_scale`` /
            ``v_scale`` are not read, ``--kv-cache-dtype fp8|int8`` sets per-token scales itself.
    """
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise refuse(f"compressed-tensors quantization_status={status!r} (the weights are not stored as {stored_as})")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise refuse(f"compressed-tensors {key}={qc[key]!r}")
    kv = qc.get("kv_cache_scheme")
    if kv is not None and not isinstance(kv, dict):  # its static k_scale / v_scale are not read (worker/kv_quant.py)
        raise refuse(f"compressed-tensors kv_cache_scheme={kv!r} (expected a mapping)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse("compressed-tensors without config_groups")
    return groups


def matches_target(patterns: list[str], module: str, module_class: str | None) -> bool:
    """compressed-tensors' target rule: a class name, an exact module name, or ``re:<regex>`` on the name."""
    for pattern in patterns:
        if pattern == module or (module_class is not None and pattern == module_class):
            return True
        if pattern.startswith("re:") and re.match(pattern[3:], module):
            return True
    return False


def _refuse(found: str) -> ValueError:
    return ValueError(f"unsupported quantized checkpoint: quantization_config {found}")


def _check_module_list(qc: dict[str, Any], key: str) -> None:
    value = qc.get(key)
    if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise _refuse(f"{key}={value!r} (expected a list of module names)")


def _block(value: Any, field: str) -> tuple[int, int]:
    if not (isinstance(value, list | tuple) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise _refuse(f"{field}={value!r} (expected [rows, columns] of one scale block, e.g. [128, 128])")
    return int(value[0]), int(value[1])


def _block_fp8(qc: dict[str, Any]) -> WeightFormat:
    """transformers' ``FineGrainedFP8Config`` as DeepSeek V3 and Qwen3-FP8 publish it."""
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(f"fmt={fmt!r} (only e4m3 FP8 weights are served)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _refuse(f"activation_scheme={scheme!r} (only dynamic: static activation scales are not served)")
    if qc.get("weight_block_size") is None:
        raise _refuse("weight_block_size=None (per-tensor quant_method fp8 is not served; block-scaled is)")
    rows, columns = _block(qc["weight_block_size"], "weight_block_size")
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise _refuse(f"scale_fmt={scale_fmt!r}")
    for key in ("modules_to_not_convert", "ignored_layers"):
        _check_module_list(qc, key)
    return WeightFormat("fp8_block", "_scale_inv", (rows, columns),
                        f"fp8 e4m3 block-scaled ({rows}x{columns}) weights")


def _compressed_tensors_fp8(qc: dict[str, Any]) -> WeightFormat:
    """llm-compressor's FP8 schemes: 8-bit float weights, one scale per tensor, channel or block."""
    groups = compressed_tensors_groups(qc, "fp8", _refuse)
    _check_module_list(qc, "ignore")
    strategies, blocks = set(), set()
    for name, group in groups.items():
        strategy, block = _float_group(name, group)
        strategies.add(strategy)
        blocks.add(block)
    if len(blocks) > 1:
        raise _refuse(f"compressed-tensors config_groups with different block_structure {sorted(map(str, blocks))}")
    block = blocks.pop()
    what = "per-block ({}x{})".format(*block) if block else "/".join(sorted(strategies))
    return WeightFormat("fp8_compressed_tensors", "_scale", block,
                        f"compressed-tensors fp8 e4m3 {what}-scaled weights")


def _float_group(name: str, group: Any) -> tuple[str, tuple[int, int] | None]:
    """One config group of a ``float-quantized`` checkpoint: (strategy, block or None)."""
    where = f"config_groups.{name}"
    if not isinstance(group, dict):
        raise _refuse(f"{where} is not a mapping")
    if group.get("format") not in (None, "float-quantized"):
        raise _refuse(f"{where}.format={group['format']!r}")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise _refuse(f"{where}.weights={weights!r}")
    for key, value in {"num_bits": 8, "type": "float", "symmetric": True}.items():
        if weights.get(key) != value:
            raise _refuse(f"{where}.weights.{key}={weights.get(key)!r} (expected {value!r})")
    if weights.get("dynamic"):
        raise _refuse(f"{where}.weights.dynamic={weights['dynamic']!r}")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise _refuse(f"{where}.weights.strategy={strategy!r} (tensor, channel or block are served)")
    for key in ("group_size", "actorder"):
        if weights.get(key) is not None:
            raise _refuse(f"{where}.weights.{key}={weights[key]!r}")
    block = _block(weights.get("block_structure"), f"{where}.weights.block_structure") \
        if strategy == "block" else None
    activations = group.get("input_activations")
    if activations and not activations.get("dynamic"):
        raise _refuse(f"{where}.input_activations.dynamic={activations.get('dynamic')!r} "
                      "(static activation scales are not served; dynamic ones are, activations unquantized)")
    if group.get("output_activations"):
        raise _refuse(f"{where}.output_activations={group['output_activations']!r}")
    return strategy, block
