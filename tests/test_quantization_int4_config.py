"""4- and 8-bit packed ``quantization_config`` s: what tpserve serves, and each refusal names the field and value.

Read by the coordinator before any rank starts (tpserve/quantization_int4.py, no torch).
"""

from __future__ import annotations

import re

import pytest

from tpserve.quantization import check_quantization_flag, checkpoint_quantization, served_quantization
from tpserve.quantization_int4 import Int4Format, int4_format, layer_formats

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
         "ignore": ["lm_head"],
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
             "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}}


def _w4a16(**weights) -> dict:
    config = {**W4A16, "config_groups": {"group_0": {"targets": ["Linear"],
                                                     "weights": {**W4A16["config_groups"]["group_0"]["weights"]}}}}
    config["config_groups"]["group_0"]["weights"].update(weights)
    return config


@pytest.mark.parametrize("qc, expected", [
    (GPTQ, Int4Format("gptq", 128, True, False, zero_plus_one=True)),
    ({**GPTQ, "lm_head": True}, Int4Format("gptq", 128, True, False, zero_plus_one=True)),  # dequantized at load
    ({**GPTQ, "dynamic": {"-:model.layers.0.mlp.*": {}}}, Int4Format("gptq", 128, True, False, zero_plus_one=True)),
    ({**GPTQ, "desc_act": True, "sym": False, "group_size": -1, "checkpoint_format": "gptq_v2"},
     Int4Format("gptq", -1, False, True, zero_plus_one=False)),
    (AWQ, Int4Format("awq", 128, False)),
    ({**AWQ, "modules_to_not_convert": ["visual", "mlp.gate"]}, Int4Format("awq", 128, False)),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "GEMM"},
     Int4Format("awq", 64, False)),
    (W4A16, Int4Format("compressed-tensors", 128, True)),
    ({**W4A16, "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}},
     Int4Format("compressed-tensors", 128, True)),  # static FP8 KV scales: accepted, not read
    (_w4a16(strategy="channel", group_size=None, symmetric=False), Int4Format("compressed-tensors", -1, False)),
    ({**GPTQ, "bits": 8}, Int4Format("gptq", 128, True, False, zero_plus_one=True, bits=8)),
    ({**GPTQ, "bits": 8, "group_size": -1, "sym": False, "desc_act": True, "checkpoint_format": "gptq_v2"},
     Int4Format("gptq", -1, False, True, zero_plus_one=False, bits=8)),
    (_w4a16(num_bits=8), Int4Format("compressed-tensors", 128, True, bits=8)),
    (_w4a16(num_bits=8, strategy="channel", group_size=None, symmetric=False),
     Int4Format("compressed-tensors", -1, False, bits=8)),
    # actorder: "weight" / "static" order GPTQ's calibration only; "group" / "dynamic" (true) store weight_g_idx
    (_w4a16(actorder="weight"), Int4Format("compressed-tensors", 128, True)),
    (_w4a16(actorder="static"), Int4Format("compressed-tensors", 128, True)),
    (_w4a16(actorder=False), Int4Format("compressed-tensors", 128, True)),
    (_w4a16(actorder="group"), Int4Format("compressed-tensors", 128, True, desc_act=True)),
    (_w4a16(actorder="dynamic", symmetric=False), Int4Format("compressed-tensors", 128, False, desc_act=True)),
    (_w4a16(actorder=True, num_bits=8), Int4Format("compressed-tensors", 128, True, desc_act=True, bits=8)),
    (_w4a16(actorder="weight", strategy="channel", group_size=None), Int4Format("compressed-tensors", -1, True)),
])
def test_served_4_and_8_bit_configs(qc: dict, expected: Int4Format) -> None:
    assert int4_format(qc) == expected
    assert checkpoint_quantization({"quantization_config": qc}) == "int4"


@pytest.mark.parametrize("qc, named", [
    ({**GPTQ, "bits": 3}, "gptq bits=3"),
    ({**GPTQ, "bits": 2}, "gptq bits=2"),
    ({**GPTQ, "bits": True}, "gptq bits=True"),
    ({**GPTQ, "lm_head": "yes"}, "gptq lm_head='yes'"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "gptq checkpoint_format='marlin'"),
    ({**GPTQ, "group_size": 0}, "gptq group_size=0"),
    ({**GPTQ, "group_size": 16}, "gptq group_size=16 (groups must be a multiple of 32 input columns"),
    ({**GPTQ, "bits": 8, "group_size": 48}, "gptq group_size=48 (groups must be a multiple of 32"),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 16, "zero_point": True, "version": "gemm"},
     "awq group_size=16 (groups must be a multiple of 32"),
    (_w4a16(group_size=24), "weights.group_size=24 (groups must be a multiple of 32"),
    ({**GPTQ, "dynamic": {"+:.*down_proj": {"bits": 8}}}, "gptq dynamic={'+:.*down_proj': {'bits': 8}} (per-module"),
    ({**GPTQ, "dynamic": {"-:.*gate": {}, ".*down_proj": {"group_size": 32}}}, "gptq dynamic={'.*down_proj'"),
    ({**AWQ, "version": "gemv"}, "awq version='gemv'"),
    ({**AWQ, "version": "exllama"}, "awq version='exllama'"),
    ({**AWQ, "zero_point": False}, "awq zero_point=False"),
    ({**AWQ, "bits": 8}, "awq bits=8"),
    ({**AWQ, "modules_to_not_convert": "visual"}, "awq modules_to_not_convert='visual' (expected a list"),
    (_w4a16(num_bits=2), "weights.num_bits=2"),
    (_w4a16(actorder="sorted"), "weights.actorder='sorted' (expected 'weight', 'static', 'group' or 'dynamic')"),
    (_w4a16(num_bits=8, type="float"), "weights.type='float'"),
    (_w4a16(actorder="group", strategy="channel", group_size=None), "weights.actorder='group' with strategy 'channel'"),
    (_w4a16(strategy="tensor"), "weights.strategy='tensor'"),
    (_w4a16(type="float"), "weights.type='float'"),
    ({**W4A16, "ignore": []}, "quantizes lm_head"),
    ({**W4A16, "kv_cache_scheme": "fp8"}, "kv_cache_scheme='fp8' (expected a mapping)"),
])
def test_unserved_4_bit_variants_are_refused_naming_the_field(qc: dict, named: str) -> None:
    with pytest.raises(ValueError) as info:
        checkpoint_quantization({"quantization_config": qc})
    assert named in str(info.value) and "unsupported quantized checkpoint" in str(info.value)


def test_compressed_tensors_config_groups_of_different_schemes_give_each_layer_its_own() -> None:
    """Mixed precision (llm-compressor's ``config_groups``): a layer takes the group naming it exactly, else the one
    whose ``re:`` pattern matches, else the one targeting every ``Linear``; two groups of different schemes at the
    same precedence, or none, are refused naming the layer. ``int4_format`` (one format) still refuses the mix."""
    mixed = {**W4A16, "config_groups": {
        "w4": {"targets": ["Linear"], "weights": {**W4A16["config_groups"]["group_0"]["weights"]}},
        "w8_attention": {"targets": ["re:.*self_attn\\..*"], "weights": {
            "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}},
        "w8_one": {"targets": ["model.layers.3.mlp.down_proj"], "weights": {
            "num_bits": 8, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64}}}}
    assert checkpoint_quantization({"quantization_config": mixed}) == "int4"
    formats = layer_formats(mixed)
    w4 = Int4Format("compressed-tensors", 128, True)
    assert formats.for_layer("model.layers.0.mlp.gate_proj") == w4
    assert formats.for_layer("model.layers.0.self_attn.k_proj") == Int4Format("compressed-tensors", -1, True, bits=8)
    assert formats.for_layer("model.layers.3.mlp.down_proj") == Int4Format("compressed-tensors", 64, False, bits=8)
    assert formats.formats == {w4, Int4Format("compressed-tensors", -1, True, bits=8),
                               Int4Format("compressed-tensors", 64, False, bits=8)}
    with pytest.raises(ValueError, match="config_groups with different weight schemes"):
        int4_format(mixed)
    clash = {**mixed, "config_groups": {**mixed["config_groups"], "w4_attention": {
        "targets": ["re:.*self_attn\\.q_proj"], "weights": {**W4A16["config_groups"]["group_0"]["weights"]}}}}
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj: compressed-tensors config_groups target "
                                         r"it with different schemes"):
        layer_formats(clash).for_layer("model.layers.0.self_attn.q_proj")
    narrow = {**mixed, "config_groups": {key: value for key, value in mixed["config_groups"].items() if key != "w4"}}
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj: stored packed, but no compressed-tensors "
                                         "config_groups target it"):
        layer_formats(narrow).for_layer("model.layers.0.mlp.up_proj")
    same = {**W4A16, "config_groups": {"a": {"targets": ["re:.*mlp.*"], "weights": W4A16["config_groups"]["group_0"][
        "weights"]}, "b": {"targets": ["re:.*attn.*"], "weights": W4A16["config_groups"]["group_0"]["weights"]}}}
    assert int4_format(same) == w4 and layer_formats(same).for_layer("anything") == w4  # one scheme: every layer


def test_what_is_reported_names_the_codes_width_not_the_loaders_layer_kind() -> None:
    """``GetModelInfo.quantization`` and the start-up lines: an 8-bit GPTQ or compressed-tensors checkpoint is
    ``int8`` although its layers are the packed kind ``"int4"``; a mixed-precision one names both widths."""
    mixed = {**W4A16, "config_groups": {
        "w4": {"targets": ["re:.*mlp.*"], "weights": {**W4A16["config_groups"]["group_0"]["weights"]}},
        "w8": {"targets": ["re:.*self_attn.*"], "weights": {**W4A16["config_groups"]["group_0"]["weights"],
                                                           "num_bits": 8, "strategy": "channel"}}}}
    cases = [(GPTQ, None, "int4"), ({**GPTQ, "bits": 8}, None, "int8"), ({**GPTQ, "bits": 8}, "int4", "int8"),
             (AWQ, None, "int4"), (_w4a16(num_bits=8), None, "int8"), (mixed, None, "int4+int8")]
    for qc, flag, want in cases:
        assert checkpoint_quantization({"quantization_config": qc}) == "int4"  # one layer kind for packed codes
        assert served_quantization({"quantization_config": qc}, flag) == want, (qc, flag)
    assert served_quantization({}, None) == "" and served_quantization({}, "int4") == "int4"


def test_a_flag_applies_only_where_it_says_what_is_stored() -> None:
    """``--quantization`` on a checkpoint stored quantized: accepted only when it names the stored width."""
    mixed = {**W4A16, "config_groups": {
        "w4": {"targets": ["re:.*mlp.*"], "weights": {**W4A16["config_groups"]["group_0"]["weights"]}},
        "w8": {"targets": ["re:.*self_attn.*"], "weights": {**W4A16["config_groups"]["group_0"]["weights"],
                                                           "num_bits": 8, "strategy": "channel"}}}}
    gptq8 = {**GPTQ, "bits": 8}
    for qc, accepted, refused in ((GPTQ, ("int4",), ("int8", "fp8")), (gptq8, ("int8",), ("int4", "fp8")),
                                  (AWQ, ("int4",), ("int8",)), (mixed, (), ("int4", "int8"))):
        check_quantization_flag({"quantization_config": qc}, None)
        for flag in accepted:
            check_quantization_flag({"quantization_config": qc}, flag)
        for flag in refused:
            stored = re.escape(served_quantization({"quantization_config": qc}, None))  # int4+int8: a "+"
            with pytest.raises(ValueError, match=rf"--quantization {flag} does not apply to this checkpoint: it is "
                                                 rf"stored quantized \({stored} weights"):
                check_quantization_flag({"quantization_config": qc}, flag)
    for flag in ("int8", "int4"):  # a float checkpoint is quantized at load
        check_quantization_flag({}, flag)
    with pytest.raises(ValueError, match=r"this checkpoint is not FP8 .*: to quantize its weights at load use --quantization int8 or int4, or drop the flag"):
        check_quantization_flag({}, "fp8")
    mxfp4 = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}}
    with pytest.raises(ValueError, match=r"this checkpoint is MXFP4 \(quantization_config quant_method mxfp4\): drop "
                                         r"the flag \(its experts are held as 8-bit codes on CPU ranks\)$"):
        check_quantization_flag(mxfp4, "fp8")
