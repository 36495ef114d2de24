"""Published FP8 and MXFP4 checkpoints through ``ModelRunner`` at tensor-parallel degrees 1 and 2 (gloo).

Four tiny checkpoints, each written in its format's on-disk layout by
tests/worker/lowbit_checkpoints.py, against ``transformers`` running the dequantized
float32 model (the values the format's reference dequantization gives):

* ``fp8_block_llama``: ``quant_method: fp8``, e4m3 weights with ``weight_scale_inv`` per
  32x64 block of every decoder linear layer (not square, so a transposed block grid
  fails; at tp 2 the KV projections' 16-row shards and o_proj's 32-column shards start
  inside a block);
* ``fp8_block_qwen3_moe``: the same format on Qwen3-MoE, every expert (and the dense MLP
  and attention) quantized in 16x32 blocks;
* ``ct_fp8_llama``: compressed-tensors ``float-quantized``, attention per tensor and the
  MLP per output channel with dynamic input activations (FP8_DYNAMIC), written by the
  compressed-tensors library;
* ``mxfp4_gpt_oss``: gpt-oss with its stacked experts as MXFP4 ``_blocks`` / ``_scales``
  (at tp 2 each rank's down_proj shard starts inside a 32-value scale group: dequantized at load); at tp 1, and
  ``mxfp4_gpt_oss_wide`` (experts 64 wide) at tp 1 and 2, a CPU rank holds the experts as exact 8-bit codes with
  a scale and offset per 32 (worker/layers/moe_mxfp4.py, the w8 kernel: tests/worker/test_lowbit_loader.py
  checks the layout).

* ``fp8_block_unconverted``: the Llama block-scaled with layer 0's down projection and layer 1's q/k/v in
  ``modules_to_not_convert`` (stored float: served in float as stored, kept fp8 or not);

and the four FP8 checkpoints again with ``--quantization fp8`` (``*_kept``): the linear
layers keep the e4m3 values and their scales (worker/layers/fp8_weights.py), multiplied by the
compiled kernel that converts them in registers (worker/kernels/cpu_linear_fp8.cpp; the one-call
decode stack included); Qwen3-MoE's experts are still dequantized at load. At tp 2 the
row-parallel shards that start inside a 64-column block keep groups of 32 columns.

Stated bound, the same for every format: the loader computes each weight as the
reference does, in float32 (``e4m3 * scale`` and ``e2m1 * 2**e`` are exact there), or
keeps the values and scales the reference multiplies, so the served model IS the
dequantized model and the logits agree within atol = rtol = 1e-4 (float32 activations:
summation order only, as for float checkpoints), and every greedy token is the reference's.
Measured: 8.6e-6 to 1.1e-5 kept, 8.6e-6 to 1.1e-5 dequantized at load, 2.6e-5 for MXFP4 experts as 8-bit codes
(the w8 kernel sums per group of 32, then scales).

Each degree runs every job in one process group (one spawn per degree).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_model
from tests.worker.lowbit_checkpoints import (GPT_OSS, GPT_OSS_WIDE, QWEN3_MOE, save_compressed_tensors_fp8,
                                            save_fp8_block, save_mxfp4)
from tests.worker.quantized_cases import QuantizedCase, case_jobs, check_case, quantized_case, records_by_degree

BLOCK_SIZE = 4
NUM_BLOCKS = 64
LOGITS_TOLERANCE = 1e-4
#: Qwen3-MoE's linear weights: attention, the dense MLP and every expert (the router stays float).
#: The FP8 checkpoints served again with ``--quantization fp8`` (as ``<name>_kept``).
FP8_KEPT = ("fp8_block_llama", "fp8_block_qwen3_moe", "ct_fp8_llama", "fp8_block_unconverted")
#: Linear weights quantized beside layers ``modules_to_not_convert`` keeps float (layer 0's down projection,
#: layer 1's q/k/v): served in float as stored, with or without --quantization fp8.
UNCONVERTED = ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
               "model.layers.1.self_attn.v_proj")
CONVERTED = re.compile(
    r"^(?!model\.layers\.0\.mlp\.down_proj|model\.layers\.1\.self_attn\.[qkv]_proj).*_proj\.weight$")
QWEN3_MOE_LINEAR = re.compile(r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def _case(name: str, checkpoint: Path, reference_dir: Path, seed: int) -> QuantizedCase:
    return quantized_case(name, checkpoint, reference_dir, seed, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def cases(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, QuantizedCase]:
    root = tmp_path_factory.mktemp("lowbit")
    qwen3_moe = save_tiny_model(QWEN3_MOE, root / "qwen3_moe")
    gpt_oss = save_tiny_model(GPT_OSS, root / "gpt_oss")
    written = {
        "fp8_block_llama": save_fp8_block(tiny_checkpoints["gqa_tied"], root / "fp8_llama",
                                          root / "fp8_llama_dequantized", block=(32, 64)),
        "fp8_block_qwen3_moe": save_fp8_block(qwen3_moe, root / "fp8_moe", root / "fp8_moe_dequantized",
                                              block=(16, 32), pattern=QWEN3_MOE_LINEAR),
        "ct_fp8_llama": save_compressed_tensors_fp8(tiny_checkpoints["mqa_untied_bias"], root / "ct_fp8",
                                                    root / "ct_fp8_dequantized"),
        "fp8_block_unconverted": save_fp8_block(tiny_checkpoints["gqa_tied"], root / "fp8_unconverted",
                                                root / "fp8_unconverted_dequantized", block=(32, 64),
                                                pattern=CONVERTED, modules_to_not_convert=UNCONVERTED),
        "mxfp4_gpt_oss": save_mxfp4(gpt_oss, root / "mxfp4", root / "mxfp4_dequantized"),
        "mxfp4_gpt_oss_wide": save_mxfp4(save_tiny_model(GPT_OSS_WIDE, root / "gpt_oss_wide"), root / "mxfp4_wide",
                                         root / "mxfp4_wide_dequantized"),
    }
    out = {name: _case(name, checkpoint, reference, seed=i)
           for i, (name, (checkpoint, reference)) in enumerate(written.items())}
    for name in FP8_KEPT:  # the same checkpoint and reference, its linear weights kept as fp8
        out[f"{name}_kept"] = replace(out[name], job=replace(out[name].job, name=f"{name}_kept", quantization="fp8"))
    return out


@pytest.fixture(scope="module")
def records_at(cases: dict[str, QuantizedCase]):
    return records_by_degree(case_jobs(cases))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["fp8_block_llama", "fp8_block_qwen3_moe", "ct_fp8_llama", "fp8_block_unconverted",
                                  "mxfp4_gpt_oss",
                                  "mxfp4_gpt_oss_wide", *(f"{name}_kept" for name in FP8_KEPT)])
def test_lowbit_checkpoint_matches_transformers_on_its_dequantized_weights(tp: int, name: str, records_at,
                                                                            cases: dict[str, QuantizedCase]) -> None:
    worst = check_case(cases[name], records_at(tp)[name], LOGITS_TOLERANCE)
    print(f"{name} tp={tp}: largest logit difference {worst:.2e}")
