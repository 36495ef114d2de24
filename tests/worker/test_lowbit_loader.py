"""The FP8 / MXFP4 sources (worker/dequantize.py) and what the loader refuses, on one rank.

* any slice of a 128x128-block FP8 weight (the published block) and of an MXFP4 expert
  stack equals the same slice of transformers' own dequantization, exactly (float32);
* ``--quantization int8`` on an FP8 checkpoint gives the int8 weights and scales of the
  dequantized float checkpoint quantized at load, exactly;
* a corrupt checkpoint is refused at load, the error naming the tensor: NaN, zero or
  missing FP8 scales, a scale grid of the wrong shape, a block size that does not divide
  the weight, e5m2 values, an e8m0 NaN, MXFP4 scales missing or blocks of the wrong shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.worker.lowbit_checkpoints import GPT_OSS, pack_mxfp4, quantize_fp8_blocks, save_fp8_block, save_mxfp4
from tests.tiny_models import save_tiny_model
from tpserve.model_config import ModelConfig
from tpserve.weight_formats import WeightFormat
from worker.dequantize import Fp8Source, Mxfp4Source, OpenFiles, Packed
from worker.loader import load_model
from worker.parallel_state import ParallelContext

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"


def test_fp8_block_source_slices_equal_transformers_dequantization(tmp_path: Path) -> None:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 384)
    q, scale = quantize_fp8_blocks(w, (128, 128))
    save_file({"w.weight": q, "w.weight_scale_inv": scale}, tmp_path / "t.safetensors")
    path = tmp_path / "t.safetensors"
    fmt = WeightFormat("fp8_block", "_scale_inv", (128, 128), "")
    source = Fp8Source(Packed("w.weight", path, "w.weight_scale_inv", path), fmt, OpenFiles())
    reference = _dequantize_fp8_weight(q, scale, [128, 128], torch.float32)
    assert source.get_shape() == (256, 384)
    for rows, columns in ((slice(None), slice(None)), (slice(37, 200), slice(100, 383)), (slice(128, 130), slice(0, 1))):
        assert torch.equal(source[rows, columns], reference[rows, columns]), (rows, columns)
    assert float((reference - w).abs().max()) <= float(w.abs().max()) / 8  # e4m3: 3 mantissa bits


def test_fp8_partial_blocks_at_the_edges_equal_transformers_dequantization(tmp_path: Path) -> None:
    """A weight that 128 does not divide (DeepSeek V3's 576-row kv_a_proj_with_mqa): ceil(N / 128) block rows."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(2))
    padded = torch.nn.functional.pad(w, (0, 84, 0, 56))  # (256, 384): whole blocks, the padding zeros
    q, scale = quantize_fp8_blocks(padded, (128, 128))
    q = q[:200, :300].contiguous()
    path = tmp_path / "t.safetensors"
    save_file({"w.weight": q, "w.weight_scale_inv": scale}, path)
    fmt = WeightFormat("fp8_block", "_scale_inv", (128, 128), "")
    source = Fp8Source(Packed("w.weight", path, "w.weight_scale_inv", path), fmt, OpenFiles())
    reference = _dequantize_fp8_weight(q, scale, [128, 128], torch.float32)
    assert source.get_shape() == (200, 300) and tuple(scale.shape) == (2, 3)
    for rows, columns in ((slice(None), slice(None)), (slice(100, 200), slice(150, 300)), (slice(199, 200), slice(255, 257))):
        assert torch.equal(source[rows, columns], reference[rows, columns]), (rows, columns)


def test_mxfp4_source_slices_equal_transformers_dequantization(tmp_path: Path) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(3, 96, 40, generator=torch.Generator().manual_seed(1))  # (E, A, B): A in 3 groups of 32
    blocks, scales = pack_mxfp4(w)
    path = tmp_path / "t.safetensors"
    save_file({"x_blocks": blocks, "x_scales": scales}, path)
    source = Mxfp4Source(Packed("x_blocks", path, "x_scales", path), OpenFiles())
    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, A, B)
    assert source.get_shape() == (3, 96, 40) == tuple(reference.shape)
    for index in ((slice(None), slice(None), slice(None)), (slice(1, 2), slice(16, 80), slice(5, 33)),
                  (slice(0, 3), slice(33, 34), slice(0, 40))):
        assert torch.equal(source[index], reference[index]), index


def test_mxfp4_as_8_bit_codes_equals_transformers_dequantization(tmp_path: Path) -> None:
    """``Mxfp4Source.read_w8``: ``s * q + o`` per group of 32 equals transformers' dequantization bit for bit, on
    every e2m1 code and e8m0 scales from 2^-127 to 2^124 (the codes in [0, 24], ``o = -12 s``); 2^125 and above
    (``24 s`` past float32) refused naming the scales."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (2, 24, 4, 16), dtype=torch.uint8, generator=generator)  # (E, B, G, 16)
    scales = torch.randint(0, 252, (2, 24, 4), dtype=torch.uint8, generator=generator)  # e8m0 0 .. 251
    scales[0, 0, 0], scales[1, 3, 2] = 0, 251
    path = tmp_path / "t.safetensors"
    save_file({"x_blocks": blocks, "x_scales": scales}, path)
    source = Mxfp4Source(Packed("x_blocks", path, "x_scales", path), OpenFiles())
    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # (E, B, A)
    q, so = source.read_w8((0, 2), (0, 24), (0, 128))
    assert q.dtype == torch.uint8 and int(q.max()) <= 24 and tuple(so.shape) == (2, 24, 4, 2)
    w = (q.float().reshape(2, 24, 4, 32) * so[..., :1] + so[..., 1:]).reshape(2, 24, 128)
    assert torch.equal(w, reference)
    q, so = source.read_w8((1, 2), (5, 9), (32, 96))  # a slice: whole groups only
    assert torch.equal((q.float().reshape(1, 4, 2, 32) * so[..., :1] + so[..., 1:]).reshape(1, 4, 64),
                       reference[1:2, 5:9, 32:96])
    with pytest.raises(ValueError, match="are not whole groups of 32"):
        source.read_w8((0, 1), (0, 4), (16, 48))
    save_file({"x_blocks": blocks, "x_scales": torch.full_like(scales, 252)}, tmp_path / "big.safetensors")
    big = Mxfp4Source(Packed("x_blocks", tmp_path / "big.safetensors", "x_scales", tmp_path / "big.safetensors"),
                      OpenFiles())
    with pytest.raises(ValueError, match="mxfp4 scales 'x_scales' hold e8m0 exponents of 2\\*\\*125 and above"):
        big.read_w8((0, 1), (0, 4), (0, 32))


def test_mxfp4_experts_are_held_as_8_bit_codes_on_the_cpu(tmp_path: Path) -> None:
    """gpt-oss 64 wide: at tp 1 every expert stack is uint8 ``(E, 2I, H)`` / ``(E, H, I)`` with ``(E, N, K / 32, 2)``
    scales, ``s * q + o`` equal to the float load of the same checkpoint exactly; at tp 2 rank 1 holds tp 1's gate
    and up units 32-63 and down columns 32-63; 10 bits a weight against float32's 32."""
    from tests.worker.lowbit_checkpoints import GPT_OSS_WIDE
    from worker.layers.moe import FusedMoE
    from worker.layers.moe_mxfp4 import MXFP4_GROUP

    model_dir = save_mxfp4(save_tiny_model(GPT_OSS_WIDE, tmp_path / "float"), tmp_path / "mxfp4",
                           tmp_path / "dequantized")[0]
    config = ModelConfig.from_pretrained(model_dir)
    whole = [m for m in _load(model_dir).modules() if isinstance(m, FusedMoE)]
    floats = [m for m in _load(tmp_path / "dequantized").modules() if isinstance(m, FusedMoE)]
    rank1 = [m for m in load_model(model_dir, config, ParallelContext(1, 2, torch.device("cpu")),
                                   torch.float32).modules() if isinstance(m, FusedMoE)]
    assert len(whole) == 2
    for moe, ref, half in zip(whole, floats, rank1, strict=True):
        for name, shape in (("gate_up_proj", (8, 128, 64)), ("down_proj", (8, 64, 64))):
            q, so = getattr(moe, name), getattr(moe, f"{name}_scale")
            assert q.dtype == torch.uint8 and tuple(q.shape) == shape
            assert tuple(so.shape) == (*shape[:2], shape[2] // MXFP4_GROUP, 2)
            w = (q.float().reshape(*shape[:2], -1, MXFP4_GROUP) * so[..., :1] + so[..., 1:]).reshape(shape)
            assert torch.equal(w, getattr(ref, name)), name
        assert torch.equal(half.gate_up_proj[:, :32], moe.gate_up_proj[:, 32:64])  # gate units 32-63
        assert torch.equal(half.gate_up_proj[:, 32:], moe.gate_up_proj[:, 96:])  # up units 32-63
        assert torch.equal(half.down_proj, moe.down_proj[:, :, 32:])
        assert torch.equal(half.down_proj_scale, moe.down_proj_scale[:, :, 1:])
        held = sum(p.numel() * p.element_size() for p in (moe.gate_up_proj, moe.down_proj, moe.gate_up_proj_scale,
                                                          moe.down_proj_scale))
        assert held / (4 * (moe.gate_up_proj.numel() + moe.down_proj.numel())) == pytest.approx(10 / 32)


@pytest.fixture(scope="module")
def fp8_llama(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8_loader")
    return save_fp8_block(tiny_checkpoints["gqa_tied"], root / "fp8", root / "dequantized", block=(32, 64))


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mxfp4_loader")
    return save_mxfp4(save_tiny_model(GPT_OSS, root / "float"), root / "mxfp4", root / "dequantized")[0]


def _load(model_dir: Path, quantization: str | None = None) -> torch.nn.Module:
    config = ModelConfig.from_pretrained(model_dir)
    return load_model(model_dir, config, ParallelContext.single(), torch.float32, quantization=quantization)


def test_int8_flag_requantizes_fp8_weights_as_it_quantizes_their_float_values(fp8_llama: tuple[Path, Path]) -> None:
    from structlog.testing import capture_logs

    fp8, dequantized = fp8_llama
    with capture_logs() as logs:
        served = dict(_load(fp8, "int8").named_parameters())
    said = [entry["event"] for entry in logs if "dequantized at load" in entry["event"]]
    assert said == ["fp8 e4m3 block-scaled (32x64) weights dequantized at load to int8 per-channel "
                    "(--quantization int8)"]
    want = dict(_load(dequantized, "int8").named_parameters())
    assert served["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.int8
    assert served.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(served[name], value), name


def _corrupted(source: Path, target: Path, edit: Callable[[dict[str, torch.Tensor], dict], None]) -> Path:
    target.mkdir()
    tensors = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, target / "model.safetensors")
    (target / "config.json").write_text(json.dumps(config))
    return target


def _set(name: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict, dict], None]:
    return lambda tensors, config: tensors.update({name: value(tensors[name])})


def _poke(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def edit(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[1] = value
        return t
    return edit


@pytest.mark.parametrize("edit, named, says", [
    (_set(Q_PROJ + "_scale_inv", _poke(float("nan"))), Q_PROJ + "_scale_inv", "non-finite or non-positive"),
    (_set(Q_PROJ + "_scale_inv", _poke(0.0)), Q_PROJ + "_scale_inv", "non-finite or non-positive"),
    (_set(Q_PROJ + "_scale_inv", lambda t: t[:, :0]), Q_PROJ + "_scale_inv", "has shape [2, 0], expected [2, 1]"),
    (lambda tensors, config: tensors.pop(Q_PROJ + "_scale_inv"), Q_PROJ, "has no scale"),
    # 64-row q_proj has 2 block rows at 32 and at 48 (one partial); 128-row gate_proj 4 at 32, 3 at 48.
    (lambda tensors, config: config["quantization_config"].update(weight_block_size=[48, 64]),
     "model.layers.0.mlp.gate_proj.weight_scale_inv", "has shape [4, 1], expected [3, 1]"),
    (_set(Q_PROJ, lambda t: t.float().to(torch.float8_e5m2)), Q_PROJ, "F8_E5M2"),
])
def test_a_corrupt_fp8_checkpoint_is_refused_naming_the_tensor(fp8_llama: tuple[Path, Path], tmp_path: Path,
                                                               edit, named: str, says: str) -> None:
    model_dir = _corrupted(fp8_llama[0], tmp_path / "corrupt", edit)
    with pytest.raises(ValueError) as info:
        _load(model_dir)
    assert named in str(info.value) and says in str(info.value), str(info.value)


@pytest.mark.parametrize("edit, named, says", [
    (_set(GATE_UP + "_scales", lambda t: t.clone().fill_(255)), GATE_UP + "_scales", "NaN (e8m0 255)"),
    (lambda tensors, config: tensors.pop(GATE_UP + "_scales"), GATE_UP + "_blocks", "has no scales"),
    (_set(GATE_UP + "_blocks", lambda t: t[..., :8].contiguous()), GATE_UP + "_blocks", "expected [experts, rows"),
    (_set(GATE_UP + "_scales", lambda t: t[:, :, :1].contiguous()), GATE_UP + "_scales", "one per 32 values"),
])
def test_a_corrupt_mxfp4_checkpoint_is_refused_naming_the_tensor(mxfp4_gpt_oss: Path, tmp_path: Path,
                                                                 edit, named: str, says: str) -> None:
    model_dir = _corrupted(mxfp4_gpt_oss, tmp_path / "corrupt", edit)
    with pytest.raises(ValueError) as info:
        _load(model_dir)
    assert named in str(info.value) and says in str(info.value), str(info.value)


@pytest.mark.parametrize("quantization", [None, "fp8", "int8", "int4"])
def test_a_nan_fp8_weight_is_refused_naming_the_tensor(fp8_llama: tuple[Path, Path], tmp_path: Path,
                                                        quantization: str | None) -> None:
    """One e4m3 code of q_proj set to NaN (0x7F): refused at load, however the weights are held. Before, dequantized
    it made every logit NaN (token 0 for every request), and ``--quantization fp8``'s kernel read it as a finite
    value."""
    model_dir = _corrupted(fp8_llama[0], tmp_path / "corrupt", _set(Q_PROJ, _poke(float("nan"))))
    assert int(load_file(model_dir / "model.safetensors")[Q_PROJ].view(torch.uint8).view(-1)[1]) == 0x7F
    with pytest.raises(ValueError) as info:
        _load(model_dir, quantization)
    assert (f"fp8 tensor {Q_PROJ!r} holds 1 NaN value (e4m3 code 0x7F or 0xFF): a corrupt checkpoint"
            in str(info.value)), str(info.value)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_float_weight_is_refused_when_quantized_at_load(fp8_llama: tuple[Path, Path], tmp_path: Path,
                                                                     quantization: str, value: float) -> None:
    """A float checkpoint with one NaN or infinite weight, quantized at load: its row's (int8) or group's (int4) scale
    would be non-finite and every request's logits NaN; refused naming the weight."""
    model_dir = _corrupted(fp8_llama[1], tmp_path / "corrupt", _set(Q_PROJ, _poke(value)))
    with pytest.raises(ValueError) as info:
        _load(model_dir, quantization)
    assert str(info.value).startswith(f"weight {Q_PROJ!r}: 1 of its "), str(info.value)
    assert "quantization rows or groups hold NaN or infinite weights: a corrupt checkpoint" in str(info.value)
