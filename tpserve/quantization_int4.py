"""Which packed 4- or 8-bit weight-only format a checkpoint is in, read from ``config.json``'s ``quantization_config``.

Every format here stores, per linear layer, ``bits``-bit codes ``q`` in ``[0, 2**bits - 1]``, a
float scale ``s`` and an integer zero point ``z`` per output row and group of ``group_size``
input columns, with ``w = s * (q - z)``; they differ in how the tensors are packed and named,
which worker/layers/int4_formats.py reads. The layers of every one of them are the int4 layer
kind (``Quantization`` ``"int4"``: packed codes, group-wise scales); 8-bit codes are held a byte
each with group-wise scales or, per channel and symmetric, as int8 (worker/layers/int8_groups.py).
Accepted:

* **GPTQ** (``quant_method: gptq``; AutoGPTQ / GPTQModel / optimum): ``bits`` 4 or 8 (8: four
  byte codes an int32, the same packing directions),
  ``group_size`` (-1: one group per row), ``sym`` true or false, ``desc_act`` with the
  checkpoint's ``g_idx`` (act-order), ``checkpoint_format`` ``gptq`` (zero points stored
  minus one, AutoGPTQ's historical layout) or ``gptq_v2``; ``lm_head: true`` (GPTQModel: the
  head stored packed too, dequantized at load: worker/layers/embedding.py);
  GPTQModel's ``dynamic`` rules that skip modules (``"-:<regex>"``: those layers are stored float),
  no per-module overrides.
* **AWQ** (``quant_method: awq``; AutoAWQ): ``version`` ``gemm`` only (the packed layout
  transformers and vLLM read), ``bits`` / ``w_bit`` 4, ``group_size`` /
  ``q_group_size``, ``zero_point`` true (the asymmetric AWQ every AutoAWQ GEMM checkpoint is);
  ``modules_to_not_convert`` (and compressed-tensors' ``ignore``, GPTQ's unquantized layers) need no
  interpretation: a layer stored in float is served in float as stored (worker/loader.py).
* **compressed-tensors** ``pack-quantized`` (llm-compressor's W4A16 and W8A16): weights
  ``num_bits`` 4 or 8, ``type`` int, ``strategy`` ``group`` or ``channel``, symmetric or not,
  ``actorder`` ``weight`` / ``static`` (an order of GPTQ's calibration only: the stored format is
  unchanged) or ``group`` / ``dynamic`` (columns grouped in activation order, with the layer's
  ``weight_g_idx``: served as GPTQ's act-order is; group strategy only), no activation or KV-cache
  quantization, ``lm_head`` ignored.

Anything else raises ``ValueError`` naming the field and its value. No torch here (the
coordinator reads this before any rank starts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tpserve.weight_formats import compressed_tensors_groups, matches_target

#: The group size of ``--quantization int4`` (round-to-nearest from a float checkpoint): the
#: published formats' usual one (GPTQ, AWQ and llm-compressor's W4A16 default), 4.5 bits a
#: weight with a float32 scale and offset per group. A rank whose input size does not divide by
#: it uses :data:`RTN_SMALL_GROUP_SIZE`.
RTN_GROUP_SIZE = 128
RTN_SMALL_GROUP_SIZE = 32
SUPPORTED_INT4 = ("GPTQ (bits 4 or 8, group_size a multiple of 32 or -1, sym or not, desc_act with g_idx), AWQ "
                  "(version gemm, bits 4), compressed-tensors pack-quantized (num_bits 4 or 8, int, strategy group "
                  "or channel, actorder)")
#: Input columns a group's size must be a multiple of: the CPU kernels' block (worker/layers/int4_matmul.py
#: ``BLOCK``, worker/layers/int8_groups.py), checked here so that the coordinator refuses such a checkpoint
#: before any rank starts.
GROUP_MULTIPLE = 32
#: Code widths of the packed formats: GPTQ and compressed-tensors store 4 or 8 bits a weight (AWQ 4 only).
PACKED_BITS = (4, 8)


@dataclass(frozen=True)
class Int4Format:
    """A packed 4- or 8-bit checkpoint format as the loaders need it.

    Attributes:
        method: ``"gptq"``, ``"awq"`` or ``"compressed-tensors"``.
        group_size: input columns per (scale, zero point); -1 for one group per output row.
        symmetric: no zero points are stored (compressed-tensors: the format's implied one is
            used, ``2 ** (bits - 1)``: 8 or 128).
        desc_act: act-order (GPTQ ``desc_act``, compressed-tensors ``actorder: group``): the checkpoint's
            ``g_idx`` / ``weight_g_idx`` says which group each input column is in.
        zero_plus_one: GPTQ ``checkpoint_format: gptq``: a stored zero point is ``z - 1``.
        bits: bits a code, 4 or 8 (``32 / bits`` codes an int32).
    """

    method: str
    group_size: int
    symmetric: bool
    desc_act: bool = False
    zero_plus_one: bool = False
    bits: int = 4


def _refuse(found: str) -> ValueError:
    return ValueError(f"unsupported quantized checkpoint: {found}; tpserve serves packed (4- or 8-bit) {SUPPORTED_INT4}")


def _group_size(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not (value == -1 or value > 0):
        raise _refuse(f"{field}={value!r} (expected a positive int, or -1 for one group per row)")
    if value != -1 and value % GROUP_MULTIPLE:
        raise _refuse(f"{field}={value!r} (groups must be a multiple of {GROUP_MULTIPLE} input columns, the "
                      "kernels' block, or -1 for one group per row)")
    return value


def int4_format(qc: dict[str, Any]) -> Int4Format:
    """The :class:`Int4Format` (4 or 8 bits) of a GPTQ, AWQ or compressed-tensors ``pack-quantized``
    ``quantization_config`` whose layers share one format.

    Raises:
        ValueError: a variant not served, naming the field and value; compressed-tensors ``config_groups`` of
            different schemes (:func:`layer_formats` serves those).
    """
    formats = layer_formats(qc)
    if len(formats.groups) != 1:
        raise _refuse(f"compressed-tensors config_groups with different weight schemes "
                      f"{sorted(str(fmt) for _, fmt in formats.groups)}")
    return formats.groups[0][1]


@dataclass(frozen=True)
class LayerFormats:
    """A packed checkpoint's format per linear layer: one for GPTQ and AWQ, one per compressed-tensors
    ``config_groups`` entry (llm-compressor's mixed-precision recipes, say W4A16 MLPs beside W8A16 attention).

    Attributes:
        method: ``"gptq"``, ``"awq"`` or ``"compressed-tensors"`` (the tensors' naming: one per checkpoint).
        groups: ``(targets, format)`` per group; ``targets`` as compressed-tensors writes them (a class name
            such as ``Linear``, an exact module name, or ``re:<regex>``), ``("Linear",)`` for GPTQ and AWQ.
    """

    method: str
    groups: tuple[tuple[tuple[str, ...], Int4Format], ...]

    def for_layer(self, module: str) -> Int4Format:
        """The format of checkpoint module ``module`` (``model.layers.0.self_attn.q_proj``): the group naming it
        exactly, else the one whose ``re:`` pattern matches it, else the one targeting every ``Linear``
        (compressed-tensors' precedence: the most specific target).

        Raises:
            ValueError: no group, or two groups at the same precedence, target the module (names both).
        """
        if len(self.groups) == 1:
            return self.groups[0][1]
        for rule in (lambda t: t == module, lambda t: t.startswith("re:") and re.match(t[3:], module) is not None,
                     lambda t: t == "Linear"):
            found = [fmt for targets, fmt in self.groups if any(rule(t) for t in targets)]
            if len(found) > 1 and len(set(found)) > 1:
                raise ValueError(f"{module}: compressed-tensors config_groups target it with different schemes "
                                 f"{sorted(map(str, set(found)))}: not served")
            if found:
                return found[0]
        raise ValueError(f"{module}: stored packed, but no compressed-tensors config_groups target it")

    @property
    def formats(self) -> set[Int4Format]:
        """Every format of the checkpoint's layers."""
        return {fmt for _, fmt in self.groups}


def layer_formats(qc: dict[str, Any]) -> LayerFormats:
    """The per-layer formats (:class:`LayerFormats`) of a GPTQ, AWQ or compressed-tensors ``pack-quantized``
    ``quantization_config``.

    Raises:
        ValueError: a variant not served, naming the field and value.
    """
    method = qc.get("quant_method")
    if method == "gptq":
        return LayerFormats("gptq", ((("Linear",), _gptq(qc)),))
    if method == "awq":
        return LayerFormats("awq", ((("Linear",), _awq(qc)),))
    if method == "compressed-tensors" and qc.get("format") == "pack-quantized":
        return _compressed_tensors(qc)
    raise _refuse(f"quantization_config quant_method={method!r} format={qc.get('format')!r}")


def _gptq(qc: dict[str, Any]) -> Int4Format:
    bits = qc.get("bits")
    if bits not in PACKED_BITS or isinstance(bits, bool):
        raise _refuse(f"gptq bits={bits!r} (4- and 8-bit GPTQ are served)")
    if not isinstance(qc.get("lm_head", False), bool):
        raise _refuse(f"gptq lm_head={qc['lm_head']!r}")  # true: a packed head, dequantized at load
    _gptq_dynamic(qc.get("dynamic"))
    checkpoint_format = qc.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise _refuse(f"gptq checkpoint_format={checkpoint_format!r}")
    sym = qc.get("sym", True)
    if not isinstance(sym, bool):
        raise _refuse(f"gptq sym={sym!r}")
    desc_act = qc.get("desc_act", False)
    if not isinstance(desc_act, bool):
        raise _refuse(f"gptq desc_act={desc_act!r}")
    return Int4Format("gptq", _group_size(qc.get("group_size", 128), "gptq group_size"), sym, desc_act,
                      zero_plus_one=checkpoint_format == "gptq", bits=bits)


def _gptq_dynamic(dynamic: Any) -> None:
    """GPTQModel's per-module rules: ``"-:<regex>"`` keys skip modules (stored float: served in float as
    stored, worker/loader.py); a ``"+:"`` or unprefixed key overrides bits, group size etc. per module.

    Raises:
        ValueError: any override rule (per-module formats are not served), or ``dynamic`` not a mapping.
    """
    if not dynamic:
        return
    if not isinstance(dynamic, dict):
        raise _refuse(f"gptq dynamic={dynamic!r} (expected a mapping of module rules)")
    overrides = {key: rule for key, rule in dynamic.items() if not str(key).startswith("-:")}
    if overrides:
        raise _refuse(f"gptq dynamic={overrides!r} (per-module overrides; '-:' rules, which skip modules, are served)")


def _awq(qc: dict[str, Any]) -> Int4Format:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(f"awq version={qc.get('version')!r} (only the GEMM layout is served)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse(f"awq bits={bits!r}")
    skipped = qc.get("modules_to_not_convert")
    if skipped is not None and not (isinstance(skipped, list) and all(isinstance(v, str) for v in skipped)):
        raise _refuse(f"awq modules_to_not_convert={skipped!r} (expected a list of module names)")
    if qc.get("zero_point", True) is not True:
        raise _refuse(f"awq zero_point={qc.get('zero_point')!r} (only AWQ with zero points is served)")
    group = _group_size(qc.get("group_size", qc.get("q_group_size", 128)), "awq group_size")
    return Int4Format("awq", group, symmetric=False)


def _compressed_tensors(qc: dict[str, Any]) -> LayerFormats:
    groups = compressed_tensors_groups(qc, "4- or 8-bit ints", _refuse)
    ignore = list(qc.get("ignore") or [])
    rules = []
    for name, group in groups.items():
        fmt = _ct_group(name, group, ignore)
        targets = group.get("targets") or []
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise _refuse(f"config_groups.{name}.targets={targets!r} (expected a list of module names or patterns)")
        rules.append((tuple(targets), fmt))
    if len({fmt for _, fmt in rules}) == 1:  # one scheme, whatever the targets: every packed layer has it
        return LayerFormats("compressed-tensors", ((("Linear",), rules[0][1]),))
    return LayerFormats("compressed-tensors", tuple(rules))


def _ct_group(name: str, group: Any, ignore: list[str]) -> Int4Format:
    if not isinstance(group, dict):
        raise _refuse(f"config_groups.{name} is not a mapping")
    if group.get("format") not in (None, "pack-quantized"):
        raise _refuse(f"config_groups.{name}.format={group['format']!r}")
    for key in ("input_activations", "output_activations"):
        if group.get(key):
            raise _refuse(f"config_groups.{name}.{key}={group[key]!r} (activation quantization)")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise _refuse(f"config_groups.{name}.weights={weights!r}")
    bits = weights.get("num_bits")
    if bits not in PACKED_BITS or isinstance(bits, bool):
        raise _refuse(f"config_groups.{name}.weights.num_bits={bits!r} (expected 4 or 8)")
    if weights.get("type") != "int":
        raise _refuse(f"config_groups.{name}.weights.type={weights.get('type')!r} (expected 'int')")
    for key in ("block_structure", "dynamic"):
        if weights.get(key):
            raise _refuse(f"config_groups.{name}.weights.{key}={weights[key]!r}")
    strategy = weights.get("strategy")
    if strategy == "group":
        group_size = _group_size(weights.get("group_size"), f"config_groups.{name}.weights.group_size")
    elif strategy == "channel":
        group_size = -1
    else:
        raise _refuse(f"config_groups.{name}.weights.strategy={strategy!r} (expected 'group' or 'channel')")
    desc_act = _ct_actorder(weights.get("actorder"), f"config_groups.{name}.weights.actorder", strategy)
    symmetric = weights.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise _refuse(f"config_groups.{name}.weights.symmetric={symmetric!r}")
    targets = list(group.get("targets") or [])
    if matches_target(targets, "lm_head", "Linear") and not matches_target(ignore, "lm_head", None):
        raise _refuse(f"config_groups.{name} quantizes lm_head (targets={targets}, ignore={ignore})")
    return Int4Format("compressed-tensors", group_size, symmetric, desc_act=desc_act, bits=bits)


#: compressed-tensors ``actorder`` values (its ``ActivationOrdering`` and aliases) that order GPTQ's
#: calibration only, and those whose groups follow the activation order (stored ``weight_g_idx``).
CT_ACTORDER_CALIBRATION_ONLY = (None, False, "weight", "static")
CT_ACTORDER_GROUPED = (True, "group", "dynamic")


def _ct_actorder(value: Any, field: str, strategy: str) -> bool:
    """Whether a compressed-tensors layer stores ``weight_g_idx`` (its groups in activation order).

    ``weight`` / ``static``: the columns were visited in activation order while quantizing, each group
    still contiguous: nothing changes at inference. ``group`` / ``dynamic`` (``true`` in older
    configs): the groups are formed in activation order and ``weight_g_idx (K,)`` says each column's,
    as GPTQ's ``desc_act`` (vLLM's compressed-tensors WNA16 scheme reads it the same way).
    """
    if isinstance(value, str):
        value = value.lower()
    if value in CT_ACTORDER_CALIBRATION_ONLY:
        return False
    if value in CT_ACTORDER_GROUPED and strategy == "group":
        return True
    raise _refuse(f"{field}={value!r}" + (" with strategy 'channel'" if value in CT_ACTORDER_GROUPED else
                                          " (expected 'weight', 'static', 'group' or 'dynamic')"))

