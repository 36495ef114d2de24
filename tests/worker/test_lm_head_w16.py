"""A 16-bit checkpoint's float LM head kept in its 16 bits on a CPU (worker/lm_head_w16.py): the float32 head's
logits bit for bit, at half its bytes. The kernel's own bits: tests/worker/test_cpu_kernels.py
(``test_linear_w16_gives_the_bits_of_linear_f32_on_the_widened_weight``)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from unittest import mock

import pytest
import torch

from tests.worker.int8_checkpoints import save_cast
from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.kernels import cpu_kernels_available
from worker.lm_head_w16 import sixteen_bit_dtype
from worker.memory import weight_bytes
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="linear_w16 is a compiled CPU kernel")


def test_the_values_decide_the_type_never_the_config() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 48, generator=g)
    assert sixteen_bit_dtype(w) is None  # float32 values: nothing would be rounded
    assert sixteen_bit_dtype(w.to(torch.bfloat16).float()) == torch.bfloat16
    halves = (w * 1e-3).to(torch.float16).float()  # finer than bfloat16's 8 bits, within float16's
    assert sixteen_bit_dtype(halves) == torch.float16
    with mock.patch("worker.lm_head_w16._CHECK_ROWS", 16):  # row chunks: one row that does not fit decides
        w2 = w.to(torch.bfloat16).float()
        w2[69, 3] += 1e-4
        assert sixteen_bit_dtype(w2) is None


def _logits(model_dir: Path, keep: bool) -> tuple[list[torch.Tensor], ModelRunner]:
    """Greedy prefill of 9 tokens then 5 decodes: each step's sampled row's logits ``(vocab,)`` float32."""
    with mock.patch("worker.loader.takes_w16_head", return_value=False) if not keep else contextlib.nullcontext():
        runner = ModelRunner(model_dir, ParallelContext.single(), torch.float32, 4)
    runner.init_kv_cache(8)
    out = runner.execute(StepPlan(1, (NewSequence(0, SamplingParams(temperature=0)),),
                                  (ScheduledChunk(0, tuple(range(3, 12)), 0, (0, 1, 2, 3)),)))
    rows, token = [runner.last_logits[0].clone()], out.sampled_token_ids[0]
    for i in range(5):
        out = runner.execute(StepPlan(2 + i, (), (ScheduledChunk(0, (token,), 9 + i),)))
        rows.append(runner.last_logits[0].clone())
        token = out.sampled_token_ids[0]
    return rows, runner


@needs_kernels
@pytest.mark.parametrize("name", ["gqa_tied", "mqa_untied_bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_checkpoints_head_stays_16_bit_with_the_float32_heads_logits(
        tiny_checkpoints: dict[str, Path], tmp_path: Path, name: str, dtype: torch.dtype) -> None:
    model_dir = save_cast(tiny_checkpoints[name], tmp_path / name, dtype)
    kept, runner = _logits(model_dir, keep=True)
    widened, baseline = _logits(model_dir, keep=False)
    head = runner.model.lm_head
    assert head.weight.dtype == dtype and baseline.model.lm_head.weight.dtype == torch.float32
    assert torch.equal(head.weight.float(), baseline.model.lm_head.weight)
    assert weight_bytes(runner.model) < weight_bytes(baseline.model)
    for step, (a, b) in enumerate(zip(kept, widened, strict=True)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max()}"
    if name == "gqa_tied":  # the embedding gathers the same 16-bit matrix, widened
        assert runner.model.model.embed_tokens.weight is head.weight
        ids = torch.tensor([0, 5, 7])
        assert torch.equal(runner.model.model.embed_tokens(ids), baseline.model.model.embed_tokens(ids))


@needs_kernels
def test_a_float32_checkpoints_head_stays_float32(tiny_checkpoints: dict[str, Path]) -> None:
    runner = ModelRunner(tiny_checkpoints["mqa_untied_bias"], ParallelContext.single(), torch.float32, 4)
    assert runner.model.lm_head.weight.dtype == torch.float32
