"""Quantized weights with multi-head latent attention (DeepSeek V3; GLM-4.7-Flash takes the same layers).

* DeepSeek's block-scaled FP8 release layout (every projection e4m3 with ``weight_scale_inv``, MLA's ``q_a_proj``,
  ``kv_a_proj_with_mqa`` and ``kv_b_proj`` included) is dequantized at load;
* ``--quantization int8`` / ``int4`` on a float checkpoint, and ``fp8`` / ``int4`` on the FP8 one, quantize the
  dense MLP and the shared and routed experts and keep the attention float (worker/models/deepseek_v3.py);
* a checkpoint stored quantized (here compressed-tensors int8: MLA's projections stored int8) is refused by the
  coordinator in one line.

References: the checkpoints holding the formats' dequantized weights, written from the definitions
(tests/worker/lowbit_checkpoints.py, int8_checkpoints.py, int4_checkpoints.py: the int8 / int4 round trip of each
MLP and expert weight, the FP8 blocks' dequantization as transformers computes it), run by the float path that
tests/worker/test_deepseek_v3.py checks against transformers; every greedy token equal, the logits within 1e-4.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model
from tests.worker.deepseek_v3_specs import MOE
from tests.worker.int4_checkpoints import save_rtn_dequantized
from tests.worker.int8_checkpoints import save_compressed_tensors, save_dequantized
from tests.worker.kv8_helpers import teacher_forced
from tests.worker.lowbit_checkpoints import save_fp8_block
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

#: Every projection of a decoder layer (DeepSeek's FP8 release quantizes them all).
EVERY_PROJECTION = re.compile(r"model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")
#: What ``--quantization`` quantizes: the dense MLP's, the shared experts' and the routed experts' weights.
MLP_WEIGHT = re.compile(r"model\.layers\.\d+\.mlp\..*(gate_proj|up_proj|down_proj)\.weight$")
PROMPTS = [list(range(3, 23)), [1, 7, 9, 11, 13]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mla_quantization")
    source = save_tiny_model(MOE, root / "source")
    fp8, dequantized = save_fp8_block(source, root / "fp8", root / "fp8_dequantized", (8, 8), EVERY_PROJECTION)
    return {"source": source, "fp8": fp8, "fp8_dequantized": dequantized,
            "int8_round_trip": save_dequantized(source, root / "int8_round_trip", MLP_WEIGHT),
            "int4_round_trip": save_rtn_dequantized(source, root / "int4_round_trip", MLP_WEIGHT),
            "fp8_int4_round_trip": save_rtn_dequantized(dequantized, root / "fp8_int4_round_trip", MLP_WEIGHT)}


def _runner(model_dir: Path, quantization: str | None) -> ModelRunner:
    runner = ModelRunner(model_dir, ParallelContext.single(), torch.float32, 16, quantization=quantization)  # type: ignore[arg-type]
    runner.init_kv_cache(48)
    return runner


@pytest.mark.parametrize(("served", "flag", "reference", "stored"), [
    ("fp8", None, "fp8_dequantized", {torch.float32}),
    ("source", "int8", "int8_round_trip", {torch.int8}),
    ("source", "int4", "int4_round_trip", {torch.uint8}),
    ("fp8", "fp8", "fp8_dequantized", {torch.float8_e4m3fn}),
    ("fp8", "int4", "fp8_int4_round_trip", {torch.uint8}),
], ids=["fp8-dequantized", "int8", "int4", "fp8-kept", "fp8-to-int4"])
def test_quantized_deepseek_gives_the_reference_tokens(checkpoints: dict[str, Path], served: str, flag: str | None,
                                                       reference: str, stored: set[torch.dtype]) -> None:
    want_logits: list[torch.Tensor] = []
    want = teacher_forced(_runner(checkpoints[reference], None), PROMPTS, None, 12, logits=want_logits)
    runner = _runner(checkpoints[served], flag)
    got_logits: list[torch.Tensor] = []
    teacher_forced(runner, PROMPTS, want, logits=got_logits)
    for got, expected in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert teacher_forced(_runner(checkpoints[served], flag), PROMPTS, None, 12) == want  # free-running too
    modules = dict(runner.model.named_modules())
    attention = {modules[f"model.layers.{i}.self_attn.{name}"].weight.dtype
                 for i in (0, 1) for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}
    assert attention == {torch.float32}  # MLA stays float
    assert {modules["model.layers.0.mlp.gate_up_proj"].weight.dtype,
            modules["model.layers.1.mlp.shared_experts.down_proj"].weight.dtype} == stored
    if flag in ("int8", "int4"):  # the routed experts held quantized: codes with their scales
        experts = modules["model.layers.1.mlp.experts"]
        assert experts.gate_up_proj.dtype in stored and experts.gate_up_proj_scale is not None


def test_a_checkpoint_stored_quantized_is_refused_at_start_up(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from launch.startup import StartupError, read_model_config

    for model_dir, flag in ((checkpoints["source"], "int4"), (checkpoints["fp8"], "fp8"), (checkpoints["fp8"], None)):
        assert read_model_config(model_dir, 1, quantization=flag).latent_attention  # served (above)
    stored, _ = save_compressed_tensors(checkpoints["source"], tmp_path / "int8", tmp_path / "int8_dequantized")
    with pytest.raises(StartupError) as error:
        read_model_config(stored, 1)
    assert str(error.value) == (f"cannot serve {stored}: its linear layers are stored int8, and multi-head latent "
                                "attention's projections (DeepseekV3ForCausalLM) load float only (a float or FP8 "
                                "checkpoint serves, with --quantization int8 or int4 for its MLP and experts)")
