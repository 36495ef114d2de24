"""FP8 weights kept as e4m3 (``--quantization fp8``): the kernel, the fallback, the sources and the loaded layers.

* ``torch.ops.tpserve_cpu.linear_fp8`` against ``x @ (e4m3 * scale).T + b`` in float64, every e4m3 code
  but NaN (subnormals and -0 included), at 1-5, 8, 9 and 17 rows of x (8 a pass, chunked) and 70 (the
  dequantize-and-matmul of prefill), groups of 8 (not a multiple of 16: the dequantizing path), 16, 64,
  128, 384 columns, with a bias. Bound, relative to max |y|: 1e-5 (float32 accumulation);
* the Python fallback (:func:`fp8_linear` without the compiled kernels): 1e-5 in float32, 2e-2 in bfloat16;
* :meth:`Fp8Source.read_codes` of a 32x64-block weight, for a row-parallel shard that starts inside a block:
  groups of 32 columns, and codes times scales equal the float32 the at-load path reads, exactly;
* a tiny Llama FP8 checkpoint loaded with ``--quantization fp8``: every decoder linear weight is e4m3 (1
  byte a weight) and equals the checkpoint's; a float checkpoint with the flag is refused, named.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.worker.lowbit_checkpoints import quantize_fp8_blocks, save_fp8_block
from tpserve.model_config import ModelConfig
from tpserve.weight_formats import WeightFormat
from worker.dequantize import Fp8Source, OpenFiles, Packed
from worker.kernels import cpu_kernels_available
from worker.layers.fp8_weights import dequantize_fp8, fp8_linear
from worker.loader import load_model
from worker.parallel_state import ParallelContext

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="the compiled CPU kernels are unavailable")
SHAPES = [(40, 64, 16), (37, 256, 64), (64, 512, 128), (24, 384, 384), (33, 96, 8)]
ROWS = (1, 2, 3, 4, 5, 8, 9, 17, 70)


def _weights(n: int, k: int, g: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # every e4m3 code but the two NaNs
    weight = codes[torch.randint(0, len(codes), (n, k), generator=gen)].view(torch.float8_e4m3fn)
    scale = torch.rand(n, k // g, generator=gen) * 0.01 + 1e-3
    return weight, scale, dequantize_fp8(weight, scale).double()


@needs_kernels
def test_linear_fp8_matches_float64() -> None:
    worst = 0.0
    for i, (n, k, g) in enumerate(SHAPES):
        weight, scale, w64 = _weights(n, k, g, seed=i)
        for m in ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            bias = torch.randn(n, generator=torch.Generator().manual_seed(100 + m))
            y = torch.ops.tpserve_cpu.linear_fp8(x, weight, scale, bias)  # (m, n)
            ref = x.double() @ w64.T + bias.double()
            err = float((y.double() - ref).abs().max() / ref.abs().max())
            assert err <= 1e-5, (n, k, g, m, err)
            worst = max(worst, err)
    print(f"linear_fp8: max error / max |y| = {worst:.2e}")


@needs_kernels
def test_dequantize_fp8_op_is_the_weights() -> None:
    weight, scale, w64 = _weights(37, 256, 64, seed=9)
    assert torch.equal(torch.ops.tpserve_cpu.dequantize_fp8(weight, scale).double(), w64)
    # e4m3 codes decode exactly: the float values are torch's own conversion
    assert torch.equal(dequantize_fp8(weight, torch.ones(37, 1)), weight.float())


def test_the_python_fallback_matches_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.layers.fp8_weights as fp8_weights

    monkeypatch.setattr(fp8_weights, "cpu_kernels_available", lambda: False)
    weight, scale, w64 = _weights(40, 128, 32, seed=4)
    x = torch.randn(3, 128)
    ref = x.double() @ w64.T
    assert float((fp8_linear(x, weight, scale).double() - ref).abs().max() / ref.abs().max()) <= 1e-5
    y16 = fp8_linear(x.bfloat16(), weight, scale)
    assert y16.dtype == torch.bfloat16 and float((y16.double() - ref).abs().max() / ref.abs().max()) < 2e-2


def test_read_codes_of_a_shard_inside_a_block_are_the_dequantized_slice(tmp_path: Path) -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    q, scale_inv = quantize_fp8_blocks(w, (32, 64))
    path = tmp_path / "t.safetensors"
    save_file({"w.weight": q, "w.weight_scale_inv": scale_inv}, path)
    source = Fp8Source(Packed("w.weight", path, "w.weight_scale_inv", path),
                       WeightFormat("fp8_block", "_scale_inv", (32, 64), ""), OpenFiles())
    for rows, columns, group in (((0, 64), (32, 160), 32), ((8, 40), (0, 256), 64), ((0, 64), (64, 128), 64)):
        codes, scale = source.read_codes(rows, columns)
        assert codes.dtype == torch.float8_e4m3fn and scale.shape == (rows[1] - rows[0], (columns[1] - columns[0]) // group)
        assert math.gcd(64, columns[0], columns[1] - columns[0]) == group
        assert torch.equal(codes, q[rows[0]:rows[1], columns[0]:columns[1]])
        assert torch.equal(dequantize_fp8(codes, scale), source[rows[0]:rows[1], columns[0]:columns[1]])


def test_fp8_flag_keeps_the_checkpoint_values(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    fp8, _ = save_fp8_block(tiny_checkpoints["gqa_tied"], tmp_path / "fp8", tmp_path / "fp8_dequantized",
                            block=(32, 64))
    stored = {}
    for path in fp8.glob("*.safetensors"):
        stored.update(load_file(path))
    model = load_model(fp8, ModelConfig.from_pretrained(fp8), ParallelContext.single(), torch.float32,
                       quantization="fp8")
    params = dict(model.named_parameters())
    o_proj = params["model.layers.0.self_attn.o_proj.weight"]
    assert o_proj.dtype == torch.float8_e4m3fn and o_proj.element_size() == 1
    assert torch.equal(o_proj.view(torch.uint8), stored["model.layers.0.self_attn.o_proj.weight"].view(torch.uint8))
    linear = [n for n in params if n.endswith("_proj.weight")]
    assert linear and all(params[n].dtype == torch.float8_e4m3fn for n in linear)
    with pytest.raises(ValueError, match="not FP8"):
        load_model(tiny_checkpoints["gqa_tied"], ModelConfig.from_pretrained(tiny_checkpoints["gqa_tied"]),
                   ParallelContext.single(), torch.float32, quantization="fp8")
