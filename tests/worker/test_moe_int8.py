"""``--quantization int8`` on mixture-of-experts models: int8 routed experts, against ``transformers``.

The reference is ``transformers`` run on the checkpoint whose expert and dense linear
weights are replaced by their int8 round trip ``q * scale`` (tests/worker/int8_checkpoints.py,
written from the definition, as tests/worker/test_int8.py does for dense models); the router,
norms, embedding and LM head stay float. Our ``ModelRunner`` serves the FLOAT checkpoint with
``--quantization int8`` (quantizing while it loads). Checked by tests/worker/moe_family_check.py:
every greedy token, logits and prompt logprobs within 1e-4 (float32), alone and 16 at once,
and the expert counts.

* Mixtral (experts ``w1/w2/w3``, every layer sparse) and Qwen3-MoE (a dense layer beside the
  sparse one) at tp 1 and 2, and with ``--enable-expert-parallel`` at tp 2;
* Mixtral with expert parallelism through the Triton experts at tp 2 (Triton's interpreter off
  CUDA: the int8 stack dequantized for the kernel);
* Qwen2-MoE (a gated shared expert), and the sigmoid-routed GLM-4.5, MiniMax-M2 and ERNIE 4.5
  (ungated shared experts, a router bias) at tp 1: the same ``FusedMoE``, other routers;
* an FP8 block-scaled Qwen3-MoE checkpoint (worker/dequantize.py) requantized to int8 at tp 2,
  against ``transformers`` on the int8 round trip of its FP8-dequantized weights;
* the loaded experts' parameters are int8 with float32 scales, and their bytes <= 0.3x float32;
* gpt-oss's and Llama 4's fused expert layouts and ``--quantization int4`` are refused in one line.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model
from tests.worker.int8_checkpoints import MOE_LINEAR_WEIGHT, save_dequantized
from tests.worker.lowbit_checkpoints import QWEN3_MOE as QWEN3_MOE_FP8_SPEC
from tests.worker.lowbit_checkpoints import save_fp8_block
from tests.worker.moe_family_check import (FamilyCase, check_job, check_records, reference_case, triton_job,
                                           with_expert_parallel)
from tests.worker.moe_specs import MIXTRAL_SPEC, QWEN2_MOE_SPEC, QWEN3_MOE_SPEC
from tests.worker.sigmoid_moe_specs import ERNIE4_5_MOE, GLM4_MOE, MINIMAX_M2
from tests.worker.tp_harness import Job, run_jobs
from tpserve.model_config import ModelConfig
from worker.layers.moe import FusedMoE
from worker.layers.moe_stacked import StackedFusedMoE
from worker.loader import load_model
from worker.models.llama4 import Llama4Experts
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

FAMILIES = {"mixtral": (MIXTRAL_SPEC, {0, 1}, 2), "qwen3_moe": (QWEN3_MOE_SPEC, {0}, 2)}
FP8 = "qwen3_moe_fp8"
#: The other families whose routed experts are :class:`FusedMoE` (checked at tp 1 only: CI time).
OTHER_FAMILIES = {"qwen2_moe": (QWEN2_MOE_SPEC, {1}, 4), "glm4_moe": (GLM4_MOE, {1}, 3),
                  "minimax_m2": (MINIMAX_M2, {0, 1}, 2), "ernie4_5_moe": (ERNIE4_5_MOE, {1}, 3)}


def _int8_jobs(case: FamilyCase, name: str) -> tuple[Job, Job]:
    """The case's jobs on the float checkpoint ``case.model_dir`` with ``--quantization int8``."""
    return tuple(dataclasses.replace(job, name=f"{name}_{job.name.rsplit('_', 1)[-1]}_int8", model_dir=case.model_dir,
                                     quantization="int8") for job in case.jobs)  # type: ignore[return-value]


def _int8_case(spec, layers: set[int], top_k: int, root: Path, name: str) -> tuple[FamilyCase, tuple[Job, Job]]:
    source = save_tiny_model(spec, root / name)
    reference = save_dequantized(source, root / f"{name}_dequantized", MOE_LINEAR_WEIGHT)
    case = dataclasses.replace(reference_case(spec, reference, layers, top_k), model_dir=str(source))
    return case, _int8_jobs(case, name)


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[FamilyCase, tuple[Job, Job]]]:
    """name -> (the reference case on the dequantized checkpoint, model_dir the float one; its int8 jobs)."""
    root = tmp_path_factory.mktemp("moe_int8")
    out = {}
    for name, (spec, layers, top_k) in FAMILIES.items():
        out[name] = _int8_case(spec, layers, top_k, root, name)
    source = save_tiny_model(QWEN3_MOE_FP8_SPEC, root / "qwen3_moe_for_fp8")
    fp8, fp8_dequantized = save_fp8_block(source, root / "fp8", root / "fp8_dequantized", block=(16, 32),
                                          pattern=MOE_LINEAR_WEIGHT)
    reference = save_dequantized(fp8_dequantized, root / "fp8_int8_dequantized", MOE_LINEAR_WEIGHT)
    case = dataclasses.replace(reference_case(QWEN3_MOE_FP8_SPEC, reference, {0}, 2), model_dir=str(fp8))
    out[FP8] = (case, _int8_jobs(case, FP8))
    return out


@pytest.fixture(scope="module")
def records_at(cases):
    cache: dict[int, dict] = {}

    def run(tp: int) -> dict:
        if tp not in cache:
            jobs = [job for name in FAMILIES for job in cases[name][1]]
            if tp == 2:
                jobs += [job for name in FAMILIES for job in with_expert_parallel(cases[name][1])]
                jobs.append(triton_job(cases["mixtral"][1][1], "int8"))
                jobs += list(cases[FP8][1])
            cache[tp] = run_jobs(jobs, tp_size=tp)
        return cache[tp]

    return run


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_int8_experts_match_transformers_on_dequantized_weights(tp: int, name: str, cases, records_at) -> None:
    case, jobs = cases[name]
    check_records(case, jobs, records_at(tp))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_int8_experts_with_expert_parallelism_at_tp2(name: str, cases, records_at) -> None:
    case, jobs = cases[name]
    check_records(case, with_expert_parallel(jobs), records_at(2))


def test_other_fused_moe_families_int8_at_tp1(tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("moe_int8_others")
    cases = {name: _int8_case(spec, layers, top_k, root, name) for name, (spec, layers, top_k) in OTHER_FAMILIES.items()}
    records = run_jobs([job for _, jobs in cases.values() for job in jobs], tp_size=1)
    for case, jobs in cases.values():
        check_records(case, jobs, records)


def test_int8_experts_through_the_triton_kernel_at_tp2(cases, records_at) -> None:
    case, jobs = cases["mixtral"]
    triton = triton_job(jobs[1], "int8")
    check_job(case, triton, records_at(2)[triton.name])


def test_fp8_moe_checkpoint_requantized_to_int8_at_tp2(cases, records_at) -> None:
    case, jobs = cases[FP8]
    check_records(case, jobs, records_at(2))


def _expert_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for module in model.modules() if isinstance(module, FusedMoE)
               for p in module.parameters())


def test_int8_experts_are_int8_in_memory(cases) -> None:
    """Mixtral tp 1: every expert stack int8 ``(E, 2I, H)`` / ``(E, H, I)`` with float32 scales ``(E, 2I)`` /
    ``(E, H)``; the router float32; experts' bytes <= 0.3x float32 (0.25 + 4 / K per weight)."""
    model_dir = cases["mixtral"][0].model_dir
    float_model = ModelRunner(model_dir, ParallelContext.single(), torch.float32, 4).model
    int8_model = ModelRunner(model_dir, ParallelContext.single(), torch.float32, 4, quantization="int8").model
    experts = [m for m in int8_model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2
    for moe in experts:
        assert moe.gate_up_proj.dtype == moe.down_proj.dtype == torch.int8
        assert tuple(moe.gate_up_proj.shape) == (8, 128, 64) and tuple(moe.down_proj.shape) == (8, 64, 64)
        assert moe.gate_up_proj_scale.dtype == moe.down_proj_scale.dtype == torch.float32
        assert tuple(moe.gate_up_proj_scale.shape) == (8, 128) and tuple(moe.down_proj_scale.shape) == (8, 64)
        assert bool((moe.gate_up_proj_scale > 0).all()) and int(moe.gate_up_proj.abs().max()) == 127
    gates = [p for n, p in int8_model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert gates and all(p.dtype == torch.float32 for p in gates)
    ratio = _expert_bytes(int8_model) / _expert_bytes(float_model)
    assert 0.25 < ratio <= 0.3, ratio


def test_int8_expert_parallel_rank_holds_its_experts_int8(cases) -> None:
    """tp 2 with expert parallelism, rank 1 loaded alone: experts 4-7 whole, int8, equal to tp 1's experts 4-7
    (scales included: whole experts are quantized from whole rows); tensor-parallel rank 1's down scales
    are the whole rows' (tp 1's), its int8 columns tp 1's second half."""
    model_dir = cases["mixtral"][0].model_dir
    config = ModelConfig.from_pretrained(model_dir)
    whole = load_model(model_dir, config, ParallelContext.single(), torch.float32, quantization="int8")
    part = load_model(model_dir, config, ParallelContext(1, 2, torch.device("cpu"), enable_expert_parallel=True),
                      torch.float32, quantization="int8")
    split = load_model(model_dir, config, ParallelContext(1, 2, torch.device("cpu")), torch.float32,
                       quantization="int8")
    for full, tp_moe in zip([m for m in whole.modules() if isinstance(m, FusedMoE)],
                            [m for m in split.modules() if isinstance(m, FusedMoE)], strict=True):
        assert torch.equal(tp_moe.down_proj_scale, full.down_proj_scale)  # (8, H): whole rows' scales
        assert torch.equal(tp_moe.down_proj, full.down_proj[:, :, 32:])
        assert torch.equal(tp_moe.gate_up_proj[:, :32], full.gate_up_proj[:, 32:64])  # gate rows 32-63
    for full, mine in zip([m for m in whole.modules() if isinstance(m, FusedMoE)],
                          [m for m in part.modules() if isinstance(m, FusedMoE)], strict=True):
        assert mine.gate_up_proj.dtype == torch.int8 and mine.first_expert == 4
        assert torch.equal(mine.gate_up_proj, full.gate_up_proj[4:])
        assert torch.equal(mine.down_proj, full.down_proj[4:])
        assert torch.equal(mine.down_proj_scale, full.down_proj_scale[4:])


def test_fused_expert_layouts_refuse_int8() -> None:
    """gpt-oss's stacked experts (with biases) and Llama 4's fused tensors fill float stacks only: one line each."""
    ctx = ParallelContext.single()
    with pytest.raises(ValueError, match="--quantization int8 is not supported for mixture-of-experts models whose "
                                         r"experts are gpt-oss's stacked experts with biases \(a checkpoint layout"):
        StackedFusedMoE(4, 16, 8, ctx, dtype=torch.float32, quantization="int8")
    with pytest.raises(ValueError, match="--quantization int8 is not supported for mixture-of-experts models whose "
                                         "experts are Llama 4's fused expert tensors"):
        Llama4Experts(4, 16, 8, ctx, dtype=torch.float32, quantization="int8")


@pytest.mark.parametrize("flag", ["int8", "int4"])
def test_fused_expert_families_are_refused_quantization_before_any_rank_starts(tmp_path: Path, flag: str) -> None:
    """The coordinator refuses ``--quantization int8|int4`` for gpt-oss and Llama 4 in one line at start-up
    (tpserve/model_registry.py FLOAT_EXPERTS_ARCHITECTURES), naming the experts' layout as the ranks' refusal
    above does; before, the ranks started and then failed (exit 1 instead of the flag checks' exit 2)."""
    from transformers import GptOssConfig, Llama4TextConfig

    from launch.startup import StartupError, read_model_config

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_local_experts=4)
    for config, experts in ((GptOssConfig(**shape, num_experts_per_tok=2, architectures=["GptOssForCausalLM"]),
                             StackedFusedMoE),
                            (Llama4TextConfig(**shape, intermediate_size_mlp=128, architectures=["Llama4ForCausalLM"]),
                             Llama4Experts)):
        model_dir = tmp_path / config.architectures[0]
        config.save_pretrained(model_dir)
        assert read_model_config(model_dir, 1).architecture == config.architectures[0]  # served without the flag
        with pytest.raises(StartupError) as error:
            read_model_config(model_dir, 1, quantization=flag)
        assert str(error.value) == (f"cannot serve {model_dir} with --quantization {flag}: its experts are "
                                    f"{experts.checkpoint_layout}, which load float only (a checkpoint layout that "
                                    "int8 and int4 weights do not fill); serve its float (or gpt-oss's MXFP4) "
                                    "checkpoint without --quantization")
