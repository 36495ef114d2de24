"""``--quantization`` and a checkpoint's ``quantization_config``: what is served, what is refused at start-up.

No torch: the coordinator decides this before any rank starts (tpserve/quantization.py).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from launch.leader import Leader
from launch.local_ranks import LocalRanks
from launch.startup import StartupError
from launch.topology import GroupLayout
from tpserve.cli import build_parser, serve_config
from tpserve.config import ClusterConfig, RankConfig
from tpserve.embedded_model import default_model_dir
from tpserve.model_config import ModelConfig
from tpserve.quantization import checkpoint_quantization, served_quantization
from tpserve.weight_formats import weight_format

#: The quantization_config of a compressed-tensors W8A16 checkpoint as llm-compressor writes it.
W8A16 = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "global_compression_ratio": None, "ignore": ["lm_head"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None, "format": None,
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "channel",
                    "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax"}}},
}


def _edited(edit) -> dict:
    config = copy.deepcopy(W8A16)
    edit(config)
    return config


def _weights(**changes):
    return lambda c: c["config_groups"]["group_0"]["weights"].update(changes)


def test_compressed_tensors_int8_weight_only_is_int8_and_float_is_none() -> None:
    assert checkpoint_quantization({"model_type": "llama"}) is None
    assert checkpoint_quantization({"quantization_config": W8A16}) == "int8"
    assert checkpoint_quantization({"quantization_config": _edited(lambda c: c.update(format="naive-quantized"))}) \
        == "int8"
    # llm-compressor's static FP8 KV-cache scales: accepted, the scales not read (per-token scales replace them).
    assert checkpoint_quantization({"quantization_config": _edited(lambda c: c.update(
        kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}))}) == "int8"
    # Decoder layers left in ``ignore`` stay float in the file; the loader quantizes them.
    assert checkpoint_quantization({"quantization_config": _edited(lambda c: c.update(
        ignore=["lm_head", "re:.*layers.0.mlp.down_proj"]))}) == "int8"


@pytest.mark.parametrize("quantization_config, named", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size=None"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "quant_method='bitsandbytes'"),
    (_edited(lambda c: c.update(format="float-quantized")), "weights.type='int'"),
    (_edited(_weights(num_bits=4)), "weights.num_bits=4"),
    (_edited(_weights(type="float")), "weights.type='float'"),
    (_edited(_weights(symmetric=False)), "weights.symmetric=False"),
    (_edited(_weights(strategy="group", group_size=128)), "weights.strategy='group'"),
    (_edited(lambda c: c["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "dynamic": True, "strategy": "token"})),
     "input_activations="),
    (_edited(lambda c: c.update(kv_cache_scheme="fp8")), "kv_cache_scheme='fp8' (expected a mapping)"),
    (_edited(lambda c: c.update(ignore=[])), "quantizes lm_head"),
    (_edited(lambda c: c.update(quantization_status="frozen")), "quantization_status='frozen'"),
])
def test_other_quantization_configs_are_refused_naming_what_was_found(quantization_config: dict, named: str) -> None:
    with pytest.raises(ValueError) as info:
        checkpoint_quantization({"quantization_config": quantization_config})
    message = str(info.value)
    assert named in message
    assert "compressed-tensors int8 weight-only" in message and "--quantization int8" in message


def test_a_3_bit_gptq_checkpoint_is_refused_at_start_up_before_any_rank(tmp_path: Path) -> None:
    model_dir = tmp_path / "gptq"
    shutil.copytree(default_model_dir(), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 3, "group_size": 128}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(StartupError, match=r"unsupported quantized checkpoint: gptq bits=3"):
        Leader(ClusterConfig.load_from(None, {"load": {"model": str(model_dir)}}))


@pytest.mark.parametrize(("quantization_config", "flag"), [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True}, "int4"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}, "int8"),
    (W8A16, "int4"),
    (None, "fp8"),
])
def test_a_flag_that_does_not_apply_is_refused_before_any_rank(tmp_path: Path, quantization_config: dict | None,
                                                              flag: str) -> None:
    """``--quantization int4`` on an 8-bit GPTQ checkpoint (it would be served 8-bit while the flag said 4), ``int8``
    on a 4-bit one, ``fp8`` on a float one: one line before any rank starts (exit code 2), not a rank's failure."""
    model_dir = tmp_path / "model"
    shutil.copytree(default_model_dir(), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(StartupError, match=rf"cannot serve {model_dir}: --quantization {flag} (does not apply to this "
                                           r"checkpoint: it is stored quantized|keeps an FP8 checkpoint's weights)"):
        Leader(ClusterConfig.load_from(None, {"load": {"model": str(model_dir), "quantization": flag}}))


def test_the_flag_reaches_every_rank_and_only_int8_is_accepted() -> None:
    config = serve_config(build_parser().parse_args(["serve", "--quantization", "int8", "--tensor-parallel-size", "2"]))
    assert config.load.quantization == "int8" and ClusterConfig().load.quantization is None
    ranks = LocalRanks(config, default_model_dir(), GroupLayout(2, 1, 0), "json")
    sent = RankConfig.from_json(ranks.rank_config(1, "unix:///x", "file:///y").to_json())  # as the rank reads it
    assert sent.cluster.load.quantization == "int8" and sent.rank == 1
    plain = LocalRanks(ClusterConfig(), default_model_dir(), GroupLayout(1, 1, 0), "json")
    sent = RankConfig.from_json(plain.rank_config(0, "unix:///x", "file:///y").to_json())
    assert sent.cluster.load.quantization is None
    fp8 = serve_config(build_parser().parse_args(["serve", "--quantization", "fp8"]))
    assert fp8.load.quantization == "fp8"  # an FP8 checkpoint's weights kept as e4m3 (worker/layers/fp8_weights.py)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "nvfp4"])
    with pytest.raises(ValueError, match="load.quantization"):
        ClusterConfig.load_from(None, {"load": {"quantization": "gptq"}})
    assert ModelConfig.from_pretrained(default_model_dir()).quantization is None


#: Block-scaled FP8 as DeepSeek V3 and Qwen3-FP8 publish it, and compressed-tensors FP8_DYNAMIC.
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
FP8_DYNAMIC = _edited(lambda c: (c.update(format="float-quantized"), c["config_groups"]["group_0"].update(
    input_activations={"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}),
    _weights(type="float")(c)))
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}


def _with(config: dict, **changes) -> dict:
    return {**copy.deepcopy(config), **changes}


def test_fp8_and_mxfp4_checkpoints_are_served_dequantized_at_load() -> None:
    """Their layers are float (the ranks dequantize while loading), so the quantization is None; the format is read."""
    for qc, kind, block in ((FP8_BLOCK, "fp8_block", (128, 128)), (FP8_DYNAMIC, "fp8_compressed_tensors", None),
                            (_with(FP8_DYNAMIC, kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}),
                             "fp8_compressed_tensors", None),
                            (_with(FP8_BLOCK, scale_fmt="ue8m0", modules_to_not_convert=None), "fp8_block",
                             (128, 128)), (MXFP4, "mxfp4", None)):
        assert checkpoint_quantization({"quantization_config": qc}) is None
        fmt = weight_format({"quantization_config": qc})
        assert fmt is not None and (fmt.kind, fmt.block) == (kind, block)
        # Reported: float weights, unless --quantization keeps them 8-bit.
        assert served_quantization({"quantization_config": qc}, None) == ""
        assert served_quantization({"quantization_config": qc}, "int8") == "int8"
    block = _edited(lambda c: (c.update(format="float-quantized"),
                               _weights(type="float", strategy="block", block_structure=[64, 128])(c)))
    fmt = weight_format({"quantization_config": block})
    assert fmt is not None and fmt.block == (64, 128) and fmt.scale_suffix == "_scale"
    assert weight_format({"quantization_config": W8A16}) is None


@pytest.mark.parametrize("quantization_config, named", [
    (_with(FP8_BLOCK, activation_scheme="static"), "activation_scheme='static'"),
    (_with(FP8_BLOCK, fmt="e5m2"), "fmt='e5m2'"),
    (_with(FP8_BLOCK, weight_block_size=[128]), "weight_block_size=[128]"),
    (_with(FP8_BLOCK, weight_block_size=[0, 128]), "weight_block_size=[0, 128]"),
    (_with(FP8_BLOCK, scale_fmt="fp32x4"), "scale_fmt='fp32x4'"),
    (_with(FP8_BLOCK, modules_to_not_convert="lm_head"), "modules_to_not_convert='lm_head'"),
    (_with(MXFP4, modules_to_not_convert=[3]), "modules_to_not_convert=[3]"),
    (_edited(lambda c: (c.update(format="float-quantized"), _weights(type="float", num_bits=4)(c))),
     "weights.num_bits=4"),
    (_edited(lambda c: (c.update(format="float-quantized"), _weights(type="float", strategy="group")(c))),
     "weights.strategy='group'"),
    (_edited(lambda c: (c.update(format="float-quantized"), _weights(type="float")(c),
                        c["config_groups"]["group_0"].update(input_activations={
                            "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}))),
     "input_activations.dynamic=False"),
    (_edited(lambda c: (c.update(format="float-quantized", kv_cache_scheme=[8]),
                        _weights(type="float")(c))), "kv_cache_scheme=[8] (expected a mapping)"),
])
def test_unsupported_fp8_and_mxfp4_variants_are_refused_naming_the_field(quantization_config: dict,
                                                                         named: str) -> None:
    with pytest.raises(ValueError) as info:
        checkpoint_quantization({"quantization_config": quantization_config})
    message = str(info.value)
    assert named in message and "\n" not in message
    assert message.startswith("unsupported quantized checkpoint: quantization_config") and "mxfp4 (gpt-oss)" in message
