"""GPU checks (``-m gpu``): bfloat16 logits against ``transformers`` at tp 1 (and tp 2 on two GPUs), the sampler.

Run by benchmarks/gpu_check.sh on a CUDA machine. ``TPSERVE_TEST_DEVICE=cpu``
runs the same code on the CPU (the script's ``--dry-run``), so that the tests'
own bugs show up before a GPU is lent; without a GPU and without that variable
they are skipped, saying so. Tolerances: tests/worker/bf16_reference.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.worker.bf16_reference import Bf16Case, bf16_cases, check_bf16
from tests.worker.tp_harness import run_jobs
from tpserve.step import SamplingParams
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext
from worker.sampler import SamplingTensors, exponential_noise, sample_tensors

DEVICE = os.environ.get("TPSERVE_TEST_DEVICE", "cuda")
MODELS = ("gqa_tied", "mqa_untied_bias")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                       reason="needs CUDA (set TPSERVE_TEST_DEVICE=cpu to run these checks on the CPU)"),
]


@pytest.fixture(scope="module")
def cases(tiny_checkpoints: dict[str, Path]) -> dict[str, Bf16Case]:
    return bf16_cases(tiny_checkpoints, MODELS, device="cuda:0" if DEVICE == "cuda" else DEVICE)


@pytest.mark.parametrize("tp", [1, 2])
def test_bf16_logits_match_transformers_bf16_on_the_device(tp: int, cases: dict[str, Bf16Case]) -> None:
    if DEVICE == "cuda" and torch.cuda.device_count() < tp:
        pytest.skip(f"tp={tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")
    records = run_jobs([case.job for case in cases.values()], tp_size=tp, device=DEVICE)
    for name, case in cases.items():
        worst = check_bf16(case, records[name], f"{name} tp={tp} on {DEVICE}")
        print(f"{name} tp={tp} on {DEVICE}: worst |ours - hf_bf16| = {worst:.4f}")


def test_weights_load_onto_the_device_and_logits_are_float32(tiny_checkpoints: dict[str, Path]) -> None:
    device = torch.device("cuda", 0) if DEVICE == "cuda" else torch.device(DEVICE)
    runner = ModelRunner(tiny_checkpoints["gqa_tied"], ParallelContext.single(device), torch.bfloat16, block_size=4)
    assert {p.device for p in runner.model.parameters()} == {device}
    hidden = torch.randn(3, runner.config.hidden_size, dtype=torch.bfloat16, device=device)  # (3, H)
    logits = runner.model.compute_logits(hidden)  # (3, V)
    assert logits.dtype == torch.float32 and logits.device == device
    reference = hidden.float() @ runner.model.lm_head.weight.float().t()  # (3, V) float32 math
    torch.testing.assert_close(logits[:, : runner.config.vocab_size], reference[:, : runner.config.vocab_size],
                               atol=1e-3, rtol=1e-3)


def test_sampler_noise_and_tokens_equal_the_cpus() -> None:
    device = torch.device("cuda", 0) if DEVICE == "cuda" else torch.device(DEVICE)
    seeds = torch.tensor([0, 1, -1, 2**62, 12345], dtype=torch.int64)
    positions = torch.tensor([0, 7, 4095, 1, 99], dtype=torch.int64)
    on_device = exponential_noise(seeds.to(device), positions.to(device), 32000).cpu()  # (5, 32000)
    assert torch.equal(on_device, exponential_noise(seeds, positions, 32000))  # bit-identical integer hash
    logits = torch.randn(5, 32000, generator=torch.Generator().manual_seed(0)) * 4  # (5, V) float32
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s) for t, k, p, s in
              [(0.0, 0, 1.0, 0), (0.7, 50, 0.9, 1), (1.0, 0, 1.0, 2), (1.3, 0, 0.5, 3), (0.9, 5, 1.0, 4)]]
    pos = [3, 9, 27, 81, 243]
    cpu_tokens = sample_tensors(logits, SamplingTensors.from_params(params, pos, "cpu"))
    device_tokens = sample_tensors(logits.to(device), SamplingTensors.from_params(params, pos, device)).cpu()
    assert torch.equal(device_tokens, cpu_tokens)


def test_int8_weights_quantized_on_the_device_equal_the_cpus_and_the_matmul_runs_there(
        tiny_checkpoints: dict[str, Path]) -> None:
    from worker.layers.int8_matmul import int8_linear

    device = torch.device("cuda", 0) if DEVICE == "cuda" else torch.device(DEVICE)
    model_dir = tiny_checkpoints["mqa_untied_bias"]
    on_device = ModelRunner(model_dir, ParallelContext.single(device), torch.bfloat16, 4, quantization="int8").model
    on_cpu = ModelRunner(model_dir, ParallelContext.single(), torch.bfloat16, 4, quantization="int8").model
    cpu_params = dict(on_cpu.named_parameters())
    for name, param in on_device.named_parameters():
        assert param.device == device
        assert torch.equal(param.cpu(), cpu_params[name]), name  # float32 division and rounding: IEEE on both
    layer = on_device.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == torch.float32
    x = torch.randn(5, layer.weight.shape[1], dtype=torch.bfloat16, device=device)  # (5, K)
    y = int8_linear(x, layer.weight, layer.weight_scale, layer.bias)  # (5, N)
    assert y.dtype == torch.bfloat16 and y.device == device
    want = x.float() @ (layer.weight.float() * layer.weight_scale[:, None]).t() + layer.bias.float()
    torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=2e-2)
