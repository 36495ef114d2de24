"""Loading 8-bit weight-only checkpoints: the packing, the grouped 8-bit kernel, and corrupt checkpoints refused
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
from worker.kernels import cpu_kernels_available
from worker.layers.int8_groups import dequantize_groups, int8_groups_linear

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="the compiled CPU kernels are unavailable")

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


@pytest.mark.parametrize("wide", [True, False])
@needs_kernels
def test_the_w8_kernel_matches_float64_at_every_row_count(wide: bool) -> None:
    """``linear_w8`` (AVX-512, and AVX2 with ``use_avx512_w8(False)``) against float64 on the dequantized
    weights: 1 to 9 rows (one pass, several streams, several passes), 70 (dequantize once and at::matmul),
    groups of 32, 64 and 128, row counts that leave remainders to the one-stream loop, with and without bias.
    The dequantization is ``s * q + o`` in float32 as ``dequantize_groups`` computes it, bit for bit."""
    generator = torch.Generator().manual_seed(4)
    torch.ops.tpserve_cpu.use_avx512_w8(wide)
    try:
        for n, k, g in ((37, 96, 32), (64, 256, 128), (5, 64, 64)):
            codes = torch.randint(0, 256, (n, k), generator=generator).to(torch.uint8)
            scales = torch.rand(n, k // g, generator=generator) + 0.01
            zeros = torch.randint(0, 256, (n, k // g), generator=generator).float()
            scale_offset = torch.stack([scales, -scales * zeros], dim=2)  # (N, groups, 2)
            w = dequantize_groups(codes, scale_offset)  # (N, K) float32
            assert torch.equal(torch.ops.tpserve_cpu.dequantize_w8(codes, scale_offset), w)
            for rows in (1, 2, 3, 4, 5, 8, 9, 70):
                x = torch.randn(rows, k, generator=generator)
                bias = torch.randn(n, generator=generator) if rows % 2 else None
                want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
                got = int8_groups_linear(x, codes, scale_offset, bias)
                bound = 2e-6 * float((x.double().abs() @ w.double().abs().t()).max())  # float32 sums
                assert float((got.double() - want).abs().max()) <= bound, (n, k, g, rows)
    finally:
        torch.ops.tpserve_cpu.use_avx512_w8(True)


def test_the_grouped_8_bit_fallback_takes_half_precision_activations() -> None:
    """bfloat16 activations (or no compiled kernels, or CUDA) take the fallback: W dequantized to x's dtype."""
    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (16, 64), generator=generator).to(torch.uint8)
    scales = torch.rand(16, 2, generator=generator) * 0.01 + 0.001
    scale_offset = torch.stack([scales, -scales * 128], dim=2)
    x = torch.randn(3, 64, generator=generator)
    got = int8_groups_linear(x.bfloat16(), codes, scale_offset)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 16)
    want = x.double() @ dequantize_groups(codes, scale_offset).double().t()
    torch.testing.assert_close(got.double(), want, atol=0.02, rtol=0.02)  # bfloat16's 8 bits


@needs_kernels
def test_the_w8_kernel_refuses_groups_it_cannot_block() -> None:
    with pytest.raises(RuntimeError, match="groups do not split K=64 into multiples of 32"):
        torch.ops.tpserve_cpu.linear_w8(torch.zeros(1, 64), torch.zeros(4, 64, dtype=torch.uint8),
                                        torch.ones(4, 4, 2), None)


def test_sound_8_bit_checkpoints_load_grouped_or_as_int8(checkpoints: dict[str, Path]) -> None:
    qkv = _load(checkpoints["gptq"]).model.layers[1].self_attn.qkv_proj
    assert qkv.int8_groups and qkv.weight.dtype == torch.uint8 and qkv.weight.shape == (128, 64)  # a byte a code
    assert qkv.weight_scale.shape == (128, 2, 2) and qkv.input_perm is not None
    qkv = _load(checkpoints["gptq_channel"]).model.layers[1].self_attn.qkv_proj
    assert not qkv.int8_groups and qkv.weight.dtype == torch.int8 and qkv.weight.shape == (128, 64)
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
    broken = _broken(checkpoints["gptq"], tmp_path / "m", config_edit=lambda qc: qc.update(group_size=96))
    with pytest.raises(ValueError, match=r"group_size=96 does not divide the input size \d+ of model.*qweight"):
        _load(broken)


def test_a_group_the_kernel_cannot_block_is_refused_naming_group_size(checkpoints: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    """Groups of 16 columns (the checkpoint's 2 scale rows become 4, each split in two), which the w8 kernel
    (groups of a multiple of 32 columns) does not take: refused by the config's ``group_size`` (the coordinator's
    check, before any rank starts), never served."""
    def regroup(tensors: dict) -> None:
        for name in [n for n in tensors if n.endswith(".scales")]:
            tensors[name] = tensors[name].repeat_interleave(2, dim=0).contiguous()
            zeros = name.removesuffix("scales") + "qzeros"
            tensors[zeros] = tensors[zeros].repeat_interleave(2, dim=0).contiguous()
        for name in [n for n in tensors if n.endswith(".g_idx")]:
            tensors[name] = (torch.arange(tensors[name].shape[0]) // 16).to(torch.int32)

    broken = _broken(checkpoints["gptq"], tmp_path / "m", regroup,
                     config_edit=lambda qc: qc.update(group_size=16, desc_act=False))
    with pytest.raises(ValueError, match=r"gptq group_size=16 \(groups must be a multiple of 32 input columns"):
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
