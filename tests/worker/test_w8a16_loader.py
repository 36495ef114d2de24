"""Loading 8-bit weight-only checkpoints: the packing, the exact plane split, and corrupt checkpoints refused
at load naming the tensor, never served.

The checkpoints are the int4 tests' tiny Llama written by tests/worker/w8a16_checkpoints.py, then broken one
tensor (or one config value) at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model
from tests.worker.int4_checkpoints import SPEC
from tests.worker.loader_helpers import _load, _rewrite
from tests.worker.w8a16_checkpoints import (gptq8_reference_dequantize, pack_bytes, save_compressed_tensors_w8a16,
                                            save_gptq8, unpack_bytes_loop)
from worker.layers.int4_formats import Int4Tensor
from worker.layers.int4_matmul import dequantize
from worker.layers.int8_planes import DEQUANTIZE_ROWS, int8_planes_linear, split_planes

LAYER = "model.layers.1.self_attn.k_proj"  # (N 32, K 64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("w8a16_loader")
    source = save_tiny_model(SPEC, root / "float")
    return {"gptq": save_gptq8(source, root / "gptq", root / "gptq_dq", group=32, sym=False, desc_act=True)[0],
            "gptq_channel": save_gptq8(source, root / "gptq_ch", root / "gptq_ch_dq", group=-1, sym=True,
                                       checkpoint_format="gptq_v2")[0],
            "ct": save_compressed_tensors_w8a16(source, root / "ct", root / "ct_dq", strategy="group",
                                                symmetric=False, group=32)[0]}


def _broken(source: Path, target: Path, edit=None, config_edit=None) -> Path:
    path = _rewrite(source, target, edit or (lambda tensors: None))
    if config_edit is not None:
        config = json.loads((path / "config.json").read_text())
        config_edit(config["quantization_config"])
        (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_gptq_8_bit_packer_is_its_independent_unpack_and_the_reference_dequantization() -> None:
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (6, 16), generator=generator)
    codes[0, :4] = torch.tensor([0, 255, 128, 255])  # the sign bit of the word set
    packed = pack_bytes(codes)
    assert packed.dtype == torch.int32 and packed.shape == (6, 4)
    assert int(packed[0, 0]) == 0xFF80FF00 - 2**32  # element 4j + i in byte i
    assert torch.equal(unpack_bytes_loop(packed), codes)
    # AutoGPTQ's dequantization (v1: stored zero + 1) of a (K 8, N 4) layer, against the definition s * (q - z).
    q, z, s = codes[:4, :8].t(), torch.tensor([[3, 200, 128, 17]]), torch.tensor([[0.5, 0.25, 2.0, 1.0]])
    w = gptq8_reference_dequantize(pack_bytes(q.t()).t(), pack_bytes(z - 1), s.half(), torch.zeros(8, dtype=torch.int32),
                                   v1=True)
    assert torch.equal(w, (s.t() * (q.t().float() - z.t().float())))


def test_8_bit_codes_split_exactly_into_two_4_bit_planes() -> None:
    generator = torch.Generator().manual_seed(2)
    n, k, group = 8, 64, 32
    t = Int4Tensor(torch.randint(0, 256, (n, k), generator=generator).to(torch.uint8),
                   torch.rand(n, 2, generator=generator) + 0.01,
                   torch.randint(0, 256, (n, 2), generator=generator).float(), torch.arange(k) // group)
    high, low = split_planes(t)
    assert int(high.codes.max()) <= 15 and int(low.codes.max()) <= 15
    # The planes denote the weights exactly: in float64 (where every term is exact) the sums are equal.
    def exact(p: Int4Tensor) -> torch.Tensor:
        return p.scales.double()[:, p.g_idx] * (p.codes.double() - p.zeros.double()[:, p.g_idx])

    assert torch.equal(exact(high) + exact(low), exact(t))
    from worker.layers.int4_matmul import pack_codes

    qweight = torch.cat([pack_codes(high.codes), pack_codes(low.codes)])  # (2N, K / 2)
    scale_offset = torch.cat([torch.stack([p.scales, -p.scales * p.zeros], dim=2) for p in (high, low)])
    torch.testing.assert_close(dequantize(qweight[:n], scale_offset[:n]) + dequantize(qweight[n:], scale_offset[n:]),
                               t.dequantize(), atol=3.1e-5, rtol=0)  # float32's ulp at |w| < 256
    for rows in (3, DEQUANTIZE_ROWS + 16):  # the int4 kernel over both planes; a prefill: dequantized once
        x, bias = torch.randn(rows, k, generator=generator), torch.randn(n, generator=generator)
        torch.testing.assert_close(int8_planes_linear(x, qweight, scale_offset, bias), x @ t.dequantize().t() + bias,
                                   atol=1e-4, rtol=1e-5)


def test_sound_8_bit_checkpoints_load_as_planes_or_int8(checkpoints: dict[str, Path]) -> None:
    qkv = _load(checkpoints["gptq"]).model.layers[1].self_attn.qkv_proj
    assert qkv.int8_planes and qkv.weight.dtype == torch.uint8 and qkv.weight.shape == (256, 32)  # 2 x 128 rows
    assert qkv.weight_scale.shape == (256, 2, 2) and qkv.input_perm is not None
    qkv = _load(checkpoints["gptq_channel"]).model.layers[1].self_attn.qkv_proj
    assert not qkv.int8_planes and qkv.weight.dtype == torch.int8 and qkv.weight.shape == (128, 64)
    assert qkv.weight_scale.shape == (128,)


@pytest.mark.parametrize("value", [float("nan"), 0.0, float("inf")])
def test_a_nan_zero_or_infinite_scale_is_refused_naming_the_tensor(checkpoints: dict[str, Path], tmp_path: Path,
                                                                    value: float) -> None:
    def corrupt(tensors: dict) -> None:
        tensors[f"{LAYER}.scales"][1, 3] = value

    with pytest.raises(ValueError, match=rf"{LAYER}.scales holds 1 zero or non-finite scales"):
        _load(_broken(checkpoints["gptq"], tmp_path / "m", corrupt))


def test_a_wrongly_shaped_packed_weight_is_refused_naming_it(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    def truncate(tensors: dict) -> None:
        tensors[f"{LAYER}.qweight"] = tensors[f"{LAYER}.qweight"][:-1].contiguous()

    with pytest.raises(ValueError, match=rf"{LAYER}.qweight has shape \[15, 32\], expected \[16, 32\]"):
        _load(_broken(checkpoints["gptq"], tmp_path / "m", truncate))

    def four_bit_zeros(tensors: dict) -> None:  # qzeros packed 8 a word, as a 4-bit checkpoint's
        tensors[f"{LAYER}.qzeros"] = tensors[f"{LAYER}.qzeros"][:, :4].contiguous()

    with pytest.raises(ValueError, match=rf"{LAYER}.qzeros has shape \[2, 4\], expected \[2, 8\]"):
        _load(_broken(checkpoints["gptq"], tmp_path / "z", four_bit_zeros))


def test_a_missing_g_idx_with_desc_act_is_refused_naming_it(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"missing \['{LAYER}.g_idx'\] \(gptq desc_act"):
        _load(_broken(checkpoints["gptq"], tmp_path / "m", lambda t: t.pop(f"{LAYER}.g_idx")))


def test_a_group_size_that_does_not_divide_k_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    broken = _broken(checkpoints["gptq"], tmp_path / "m", config_edit=lambda qc: qc.update(group_size=48))
    with pytest.raises(ValueError, match=r"group_size=48 does not divide the input size \d+ of model.*qweight"):
        _load(broken)


def test_a_group_the_kernel_cannot_block_is_refused_naming_the_tensor(checkpoints: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    """Groups of 16 columns: the checkpoint's 2 scale rows become 4 (each split in two), which the planes'
    int4 kernel (blocks of 32 columns) cannot take: refused at load, named, never served."""
    def regroup(tensors: dict) -> None:
        for name in [n for n in tensors if n.endswith(".scales")]:
            tensors[name] = tensors[name].repeat_interleave(2, dim=0).contiguous()
            zeros = name.removesuffix("scales") + "qzeros"
            tensors[zeros] = tensors[zeros].repeat_interleave(2, dim=0).contiguous()
        for name in [n for n in tensors if n.endswith(".g_idx")]:
            tensors[name] = (torch.arange(tensors[name].shape[0]) // 16).to(torch.int32)

    broken = _broken(checkpoints["gptq"], tmp_path / "m", regroup,
                     config_edit=lambda qc: qc.update(group_size=16, desc_act=False))
    with pytest.raises(ValueError, match=r"model\.layers\.\d+\.\S+\.scales: 8-bit groups of 16 columns are not a "
                                         r"multiple of 32"):
        _load(broken)


def test_a_symmetric_channel_zero_point_other_than_128_is_refused(checkpoints: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    def corrupt(tensors: dict) -> None:
        tensors[f"{LAYER}.qzeros"][0, 1] += 5  # one output row's zero point 128 -> 133

    with pytest.raises(ValueError, match=rf"{LAYER}.qzeros: symmetric 8-bit zero points must be 128, found 133"):
        _load(_broken(checkpoints["gptq_channel"], tmp_path / "m", corrupt))


def test_compressed_tensors_missing_zero_point_and_bad_shapes_are_named(checkpoints: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"missing \['{LAYER}.weight_zero_point'\]"):
        _load(_broken(checkpoints["ct"], tmp_path / "a", lambda t: t.pop(f"{LAYER}.weight_zero_point")))

    def four_bit_packing(tensors: dict) -> None:
        tensors[f"{LAYER}.weight_packed"] = tensors[f"{LAYER}.weight_packed"][:, :8].contiguous()

    with pytest.raises(ValueError, match=rf"{LAYER}.weight_packed has shape \[32, 8\], expected \[32, 16\]"):
        _load(_broken(checkpoints["ct"], tmp_path / "b", four_bit_packing))

    def nan_scale(tensors: dict) -> None:
        tensors[f"{LAYER}.weight_scale"][2, 0] = float("nan")

    with pytest.raises(ValueError, match=rf"{LAYER}.weight_scale holds 1 zero or non-finite scales"):
        _load(_broken(checkpoints["ct"], tmp_path / "c", nan_scale))
