"""Loading 4-bit checkpoints: a corrupt one is refused at load naming the tensor, never served.

The checkpoints are the tiny Llama of tests/worker/test_int4.py written by tests/worker/int4_checkpoints.py,
then broken one tensor (or one config value) at a time.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.tiny_models import save_tiny_model
from tests.worker.int4_checkpoints import (SPEC, save_compressed_tensors_group_actorder,
                                           save_compressed_tensors_w4a16, save_gptq)
from tests.worker.loader_helpers import _load, _rewrite
from tests.worker.shard_fakes import ShardOnlyContext
from tpserve.quantization_int4 import Int4Format
from worker.layers.int4_weights import PackedPart, new_int4_weights
from worker.layers.linear import RowParallelLinear

LAYER = "model.layers.1.self_attn.k_proj"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int4_loader")
    source = save_tiny_model(SPEC, root / "float")
    return {"gptq": save_gptq(source, root / "gptq", root / "gptq_dq", group=32, sym=False, desc_act=True)[0],
            "ct": save_compressed_tensors_w4a16(source, root / "ct", root / "ct_dq", strategy="group",
                                                symmetric=False, group=32)[0],
            "ct_actorder": save_compressed_tensors_group_actorder(source, root / "cta", root / "cta_dq", group=32,
                                                                  symmetric=True, seed=2)[0]}


def _broken(source: Path, target: Path, edit=None, config_edit=None) -> Path:
    path = _rewrite(source, target, edit or (lambda tensors: None))
    if config_edit is not None:
        config = json.loads((path / "config.json").read_text())
        config_edit(config["quantization_config"])
        (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_sound_checkpoint_loads_packed(checkpoints: dict[str, Path]) -> None:
    qkv = _load(checkpoints["gptq"]).model.layers[1].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.uint8 and qkv.weight.shape == (128, 32)  # (q 64 + k 32 + v 32, 64 / 2)
    assert qkv.weight_scale.shape == (128, 2, 2) and qkv.input_perm is not None  # act-order: columns gathered


@pytest.mark.parametrize("value", [float("nan"), 0.0, float("inf")])
def test_a_nan_zero_or_infinite_scale_is_refused_naming_the_tensor(checkpoints: dict[str, Path], tmp_path: Path,
                                                                    value: float) -> None:
    def corrupt(tensors: dict) -> None:
        tensors[f"{LAYER}.scales"][1, 3] = value

    with pytest.raises(ValueError, match=rf"^{LAYER}.scales holds 1 zero or non-finite scales"):
        _load(_broken(checkpoints["gptq"], tmp_path / "m", corrupt))


def test_a_wrongly_shaped_packed_weight_is_refused_naming_it(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    def truncate(tensors: dict) -> None:
        tensors[f"{LAYER}.qweight"] = tensors[f"{LAYER}.qweight"][:-1].contiguous()

    with pytest.raises(ValueError, match=rf"^{LAYER}.qweight has shape \[7, 32\], expected \[8, 32\]"):
        _load(_broken(checkpoints["gptq"], tmp_path / "m", truncate))


def test_a_missing_g_idx_with_desc_act_is_refused_naming_it(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"missing \['{LAYER}.g_idx'\] \(gptq desc_act"):
        _load(_broken(checkpoints["gptq"], tmp_path / "m", lambda t: t.pop(f"{LAYER}.g_idx")))


@pytest.mark.parametrize("config_edit", [lambda qc: qc.update(desc_act=False), lambda qc: qc.pop("desc_act")],
                         ids=["desc_act-false", "desc_act-unset"])
def test_an_act_order_g_idx_under_a_config_without_desc_act_is_refused(checkpoints: dict[str, Path], tmp_path: Path,
                                                                      config_edit) -> None:
    """Not read, it would be served wrong (before: every token differed from AutoGPTQ's dequantization)."""
    with pytest.raises(ValueError, match=r"^model\.layers\.\d\.\S+\.g_idx is not k // group_size \(group_size=32\) "
                                         r"but quantization_config's desc_act is false or unset"):
        _load(_broken(checkpoints["gptq"], tmp_path / "m", config_edit=config_edit))


def test_a_group_size_that_does_not_divide_k_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    broken = _broken(checkpoints["gptq"], tmp_path / "m", config_edit=lambda qc: qc.update(group_size=96))
    with pytest.raises(ValueError, match=r"group_size=96 does not divide the input size \d+ of model.*qweight"):
        _load(broken)


def test_a_g_idx_out_of_range_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    def corrupt(tensors: dict) -> None:
        tensors[f"{LAYER}.g_idx"][0] = 9

    with pytest.raises(ValueError, match=rf"^{LAYER}.g_idx holds groups outside \[0, 2\)"):
        _load(_broken(checkpoints["gptq"], tmp_path / "m", corrupt))


def test_compressed_tensors_missing_zero_point_and_bad_shape_are_named(checkpoints: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"missing \['{LAYER}.weight_zero_point'\]"):
        _load(_broken(checkpoints["ct"], tmp_path / "a", lambda t: t.pop(f"{LAYER}.weight_zero_point")))

    def wrong_shape(tensors: dict) -> None:
        tensors[f"{LAYER}.weight_shape"] = torch.tensor([32, 128])

    with pytest.raises(ValueError, match=rf"^{LAYER}.weight_shape is \[32, 128\], expected \[32, 64\]"):
        _load(_broken(checkpoints["ct"], tmp_path / "b", wrong_shape))


def test_compressed_tensors_group_actorder_reads_weight_g_idx_and_refuses_it_missing_or_out_of_range(
        checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """``actorder: group``: the layer's columns gathered by ``weight_g_idx`` (as GPTQ's act-order); without the
    tensor, or with a group outside the layer's, refused naming it."""
    qkv = _load(checkpoints["ct_actorder"]).model.layers[1].self_attn.qkv_proj
    assert qkv.input_perm is not None and not torch.equal(qkv.input_perm, torch.arange(64))
    with pytest.raises(ValueError, match=rf"missing \['{LAYER}.weight_g_idx'\] \(compressed-tensors desc_act"):
        _load(_broken(checkpoints["ct_actorder"], tmp_path / "a", lambda t: t.pop(f"{LAYER}.weight_g_idx")))

    def corrupt(tensors: dict) -> None:
        tensors[f"{LAYER}.weight_g_idx"][5] = 2

    with pytest.raises(ValueError, match=rf"^{LAYER}.weight_g_idx holds groups outside \[0, 2\)"):
        _load(_broken(checkpoints["ct_actorder"], tmp_path / "b", corrupt))


def test_a_fused_layer_with_parts_stored_unquantized_beside_packed_ones_is_refused(checkpoints: dict[str, Path],
                                                                                   tmp_path: Path) -> None:
    """k_proj stored float while q_proj and v_proj are packed (one fused qkv layer): refused naming the tensor
    (an unquantized layer as a whole is served in float: tests/worker/test_int4.py, ``ct_ignored_layers``)."""
    def unquantize_k(tensors: dict) -> None:
        for suffix in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"):
            tensors.pop(f"{LAYER}.{suffix}")
        tensors[f"{LAYER}.weight"] = torch.randn(32, 64)

    with pytest.raises(ValueError, match=rf"'{LAYER}.weight' is stored unquantized in a quantized checkpoint beside "
                                         "quantized parts of the same fused layer"):
        _load(_broken(checkpoints["ct"], tmp_path / "m", unquantize_k))


def test_act_order_groups_spread_over_row_parallel_ranks_are_refused() -> None:
    """At tp 2 a row-parallel rank holds half the input columns; a random act order puts parts of most
    groups on each rank, which the kernel's contiguous groups cannot express: refused, naming the tensor."""
    ctx = SimpleNamespace(tp_size=2, tp_rank=0, device=torch.device("cpu"))
    layer = RowParallelLinear(128, 16, ctx, bias=False, dtype=torch.float32, quantization="int4")
    fmt = Int4Format("gptq", 32, False, desc_act=True)
    g_idx = torch.randperm(128, generator=torch.Generator().manual_seed(0)) // 32
    parts = {"qweight": torch.zeros(16, 16, dtype=torch.int32), "qzeros": torch.zeros(4, 2, dtype=torch.int32),
             "scales": torch.ones(4, 16, dtype=torch.float16), "g_idx": g_idx.to(torch.int32)}
    with pytest.raises(ValueError, match=r"o_proj: act-order \(its g_idx, desc_act / actorder\) spreads groups over the ranks"):
        for part, tensor in parts.items():
            layer.weight_loader(layer.weight, PackedPart(tensor, part, fmt, f"o_proj.{part}"))


def test_an_input_width_the_kernel_cannot_block_is_refused_with_the_way_out() -> None:
    """stories260k's MLP (intermediate 172) under --quantization int4: the message says the layer's shape and what
    serves it instead, not only the number."""
    with pytest.raises(ValueError, match=r"a linear layer of 64 outputs has 172 input columns on this rank .*"
                                         r"serve the model with --quantization int8"):
        new_int4_weights(SimpleNamespace(weight_loader=None), (64, 172), torch.device("cpu"))


def test_another_quantization_flag_on_a_packed_checkpoint_is_refused(checkpoints: dict[str, Path]) -> None:
    """``--quantization int8`` (or ``fp8``) on a GPTQ checkpoint: refused naming the flag and the checkpoint's method,
    not silently served as stored while the ``serving`` line reports the flag; ``int4`` (its own kind) is accepted."""
    from tpserve.model_config import ModelConfig
    from worker.loader import load_model
    from worker.parallel_state import ParallelContext

    config = ModelConfig.from_pretrained(checkpoints["gptq"])
    for flag in ("int8", "fp8"):
        with pytest.raises(ValueError, match=rf"--quantization {flag} does not apply to this checkpoint: it is stored "
                                             r"quantized \(int4 weights, quantization_config quant_method 'gptq'\)"):
            load_model(checkpoints["gptq"], config, ParallelContext.single(), torch.float32, quantization=flag)
    load_model(checkpoints["gptq"], config, ParallelContext.single(), torch.float32, quantization="int4")


def test_rtn_groups_a_rank_would_cut_are_refused_with_the_way_out() -> None:
    """The embedded model's o_proj (128 input columns: RTN groups of 128) at tp 2: each rank would hold half a
    group. The groups stay the whole rows' (the same weights at every degree), so the load is refused naming the
    flags that serve it: a smaller --tensor-parallel-size, or --quantization int8."""
    layer = RowParallelLinear(128, 32, ShardOnlyContext(tp_rank=1, tp_size=2, device=torch.device("cpu")),
                              bias=False, dtype=torch.float32, quantization="int4")
    with pytest.raises(ValueError, match=r"groups of 128 columns do not split this rank's 64 input columns \(the "
                                         r"layer's 128 split over the ranks\): serve it at a smaller "
                                         r"--tensor-parallel-size, or with --quantization int8"):
        layer.weight_loader(layer.weight, torch.randn(32, 128))
    # Groups of 32 (an input width 128 does not divide) split at any degree that leaves whole ones: served.
    layer = RowParallelLinear(96, 32, ShardOnlyContext(tp_rank=1, tp_size=3, device=torch.device("cpu")),
                              bias=False, dtype=torch.float32, quantization="int4")
    layer.weight_loader(layer.weight, torch.randn(32, 96))
    assert layer.weight.shape == (32, 16)  # 32 columns, two codes a byte


def test_an_autogptq_quantize_config_json_is_read_as_its_quantization_config(checkpoints: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    """Older AutoGPTQ checkpoints keep their settings in quantize_config.json, not config.json (vLLM reads it too):
    the same tensors load the same; with neither, the refusal says why, listing a few of the packed tensors."""
    def legacy(directory: Path, keep_file: bool) -> Path:
        path = _broken(checkpoints["gptq"], directory)
        config = json.loads((path / "config.json").read_text())
        settings = config.pop("quantization_config")
        settings.pop("quant_method")  # AutoGPTQ's file does not say it
        (path / "config.json").write_text(json.dumps(config))
        if keep_file:
            (path / "quantize_config.json").write_text(json.dumps(settings))
        return path

    want = _load(checkpoints["gptq"]).model.layers[1].self_attn.qkv_proj
    got = _load(legacy(tmp_path / "legacy", True)).model.layers[1].self_attn.qkv_proj
    assert torch.equal(got.weight, want.weight) and torch.equal(got.weight_scale, want.weight_scale)
    with pytest.raises(ValueError) as error:
        _load(legacy(tmp_path / "none", False))
    message = str(error.value)
    assert message.startswith("checkpoint has ") and "... and " in message and len(message) < 1000, message
    assert message.endswith("they are packed quantized tensors (GPTQ / AWQ / compressed-tensors), but config.json "
                            "has no quantization_config (nor is there a quantize_config.json or quant_config.json "
                            "beside it)")
