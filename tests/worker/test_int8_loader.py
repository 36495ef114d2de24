"""Loading compressed-tensors int8 checkpoints: what is read, what is derived, and errors that name the weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.worker.int8_checkpoints import quantize_definition, save_compressed_tensors
from tests.worker.loader_helpers import _load, _rewrite

LAYER = "model.layers.1.self_attn.k_proj"


@pytest.fixture(scope="module")
def compressed(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("int8_loader")
    return save_compressed_tensors(tiny_checkpoints["gqa_tied"], root / "ct", root / "ct_dequantized")[0]


def test_int8_tensors_and_scales_are_copied_as_stored(compressed: Path) -> None:
    stored = load_file(compressed / "model.safetensors")
    qkv = _load(compressed).model.layers[1].self_attn.qkv_proj
    q_rows = stored["model.layers.1.self_attn.q_proj.weight"].shape[0]
    k = slice(q_rows, q_rows + stored[f"{LAYER}.weight"].shape[0])
    assert torch.equal(qkv.weight[k], stored[f"{LAYER}.weight"])  # int8, the full range [-128, 127] allowed
    assert torch.equal(qkv.weight_scale[k], stored[f"{LAYER}.weight_scale"].float().reshape(-1))  # (N, 1) bf16
    assert qkv.weight_scale.computed_shard_ids == set()  # nothing derived


def test_a_layer_left_float_in_the_checkpoint_is_quantized_at_load(compressed: Path, tiny_checkpoints,
                                                                   tmp_path: Path) -> None:
    float_weight = load_file(tiny_checkpoints["gqa_tied"] / "model.safetensors")[f"{LAYER}.weight"]

    def leave_float(tensors: dict) -> None:  # what compressed-tensors' ``ignore`` leaves in the file
        tensors[f"{LAYER}.weight"] = float_weight
        del tensors[f"{LAYER}.weight_scale"]

    qkv = _load(_rewrite(compressed, tmp_path / "m", leave_float)).model.layers[1].self_attn.qkv_proj
    q, scale = quantize_definition(float_weight)
    k = slice(qkv.q_size, qkv.q_size + qkv.kv_size)
    assert torch.equal(qkv.weight[k], q) and torch.equal(qkv.weight_scale[k], scale)
    assert qkv.weight_scale.computed_shard_ids == {"k"}


def test_a_missing_scale_is_named(compressed: Path, tmp_path: Path) -> None:
    broken = _rewrite(compressed, tmp_path / "m", lambda t: t.pop(f"{LAYER}.weight_scale"))
    with pytest.raises(ValueError, match=rf"missing weights: \['{LAYER}.weight_scale'\]"):
        _load(broken)


def test_a_group_wise_scale_is_refused_naming_the_weight(compressed: Path, tmp_path: Path) -> None:
    def group_wise(tensors: dict) -> None:
        tensors[f"{LAYER}.weight_scale"] = tensors[f"{LAYER}.weight_scale"].repeat(1, 2)  # (N, 2): two groups

    with pytest.raises(ValueError, match=rf"'{LAYER}.weight_scale'.*only per-channel int8"):
        _load(_rewrite(compressed, tmp_path / "m", group_wise))


def test_a_stored_zero_point_must_be_zero(compressed: Path, tmp_path: Path) -> None:
    rows = load_file(compressed / "model.safetensors")[f"{LAYER}.weight"].shape[0]

    def zero_point(value: int):
        return lambda t: t.update({f"{LAYER}.weight_zero_point": torch.full((rows, 1), value, dtype=torch.int8)})

    _load(_rewrite(compressed, tmp_path / "zero", zero_point(0)))  # symmetric checkpoints of older versions
    with pytest.raises(ValueError, match=rf"'{LAYER}.weight_zero_point' is not zero: asymmetric"):
        _load(_rewrite(compressed, tmp_path / "three", zero_point(3)))


def test_int8_tensors_without_a_quantization_config_are_refused(compressed: Path, tmp_path: Path) -> None:
    stored = load_file(compressed / "model.safetensors")
    float_dir = compressed.parent / "ct_dequantized"  # float config.json, no quantization_config

    def int8_weight(tensors: dict) -> None:
        tensors[f"{LAYER}.weight"] = stored[f"{LAYER}.weight"]

    with pytest.raises(ValueError, match=rf"'{LAYER}.weight'.*int8 tensor for a float parameter"):
        _load(_rewrite(float_dir, tmp_path / "m", int8_weight))


@pytest.mark.parametrize("layer", [LAYER, "model.layers.0.mlp.down_proj"])  # column- and row-parallel
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_scale_is_refused_naming_the_tensor(compressed: Path, tmp_path: Path, layer: str,
                                                         bad: float) -> None:
    def corrupt(tensors: dict) -> None:
        tensors[f"{layer}.weight_scale"][3] = bad  # before: served all-<unk> tokens with NaN logprobs

    with pytest.raises(ValueError, match=rf"'{layer}.weight_scale'.*output row 3 is {bad}.*corrupt checkpoint"):
        _load(_rewrite(compressed, tmp_path / "m", corrupt))


@pytest.mark.parametrize("layer", [LAYER, "model.layers.0.mlp.down_proj"])
def test_a_zero_scale_of_a_non_zero_row_is_refused(compressed: Path, tmp_path: Path, layer: str) -> None:
    stored = load_file(compressed / "model.safetensors")
    assert stored[f"{layer}.weight"][2].any()

    def corrupt(tensors: dict) -> None:
        tensors[f"{layer}.weight_scale"][2] = 0  # before: row 2 served as zeros, silently

    with pytest.raises(ValueError, match=rf"'{layer}.weight(_scale)?'.*output row 2 is 0 but the row's int8"):
        _load(_rewrite(compressed, tmp_path / "m", corrupt))


def test_a_zero_scale_of_a_zero_row_is_accepted(compressed: Path, tmp_path: Path) -> None:
    def zero_row(tensors: dict) -> None:  # a pruned output channel: scale 0, weights 0
        tensors[f"{LAYER}.weight"][2] = 0
        tensors[f"{LAYER}.weight_scale"][2] = 0

    qkv = _load(_rewrite(compressed, tmp_path / "m", zero_row)).model.layers[1].self_attn.qkv_proj
    assert float(qkv.weight_scale[qkv.q_size + 2]) == 0.0 and not qkv.weight[qkv.q_size + 2].any()
