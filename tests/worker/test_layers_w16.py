"""A 16-bit checkpoint's decoder projections kept in their 16 bits on a CPU (worker/layers_w16.py): the float32-widened
model's logits bit for bit on every path (the compiled decode region, its ops, the module path, a prefill-sized
product), at half the projections' bytes. The kernel's own bits: tests/worker/test_cpu_kernels.py
(``test_linear_w16_gives_the_bits_of_linear_f32_on_the_widened_weight``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch

from tests.worker.int8_checkpoints import save_cast
from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.kernels import cpu_kernels_available
from worker.layers.decode_block import disable_decode_blocks
import worker.layers.linear as linear_module
from worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker.layers_w16 import PROJECTIONS, keep_layers_16bit
from worker.memory import weight_bytes
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="linear_w16 is a compiled CPU kernel")

#: Prompt lengths: the first is longer than the kernels' 64 rows (a prefill-sized product on a widened copy).
PROMPTS = (70, 9, 3)


def _projections(runner: ModelRunner) -> list[torch.nn.Module]:
    return [m for m in runner.model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
            and any(m is getattr(parent, name, None) for parent in runner.model.modules() for name in PROJECTIONS)]


def _run(model_dir: Path, keep: bool, path: str) -> tuple[list[torch.Tensor], ModelRunner, int]:
    """Three sequences prefilled in one step, then 6 decode steps of all three (greedy): each step's logits
    ``(3, vocab)`` float32, the runner, and the decode steps the compiled region took. ``path``: ``region``,
    ``ops`` (the compiled stack's ops) or ``modules`` (the module path)."""
    off = mock.patch("worker.loader.takes_w16_layers", return_value=False)
    with off if not keep else contextlib.nullcontext():
        runner = ModelRunner(model_dir, ParallelContext.single(), torch.float32, 4)
    runner.init_kv_cache(64)
    if path == "modules":
        disable_decode_blocks(runner.model)
    with _region(path != "ops"):
        before = torch.ops.tpserve_cpu.decode_region_steps()
        blocks, chunks = 0, []
        for seq, n in enumerate(PROMPTS):
            need = -(-(n + 8) // 4)
            chunks.append(ScheduledChunk(seq, tuple(3 + (7 * seq + 5 * i) % 60 for i in range(n)), 0,
                                         tuple(range(blocks, blocks + need))))
            blocks += need
        greedy = SamplingParams(temperature=0)
        out = runner.execute(StepPlan(0, tuple(NewSequence(s, greedy) for s in range(3)), tuple(chunks)))
        rows, tokens = [runner.last_logits.clone()], list(out.sampled_token_ids)
        for step in range(6):
            out = runner.execute(StepPlan(1 + step, (), tuple(ScheduledChunk(s, (tokens[s],), n + step)
                                                             for s, n in enumerate(PROMPTS))))
            rows.append(runner.last_logits.clone())
            tokens = list(out.sampled_token_ids)
        return rows, runner, torch.ops.tpserve_cpu.decode_region_steps() - before


@contextlib.contextmanager
def _region(enabled: bool) -> Iterator[None]:
    torch.ops.tpserve_cpu.use_decode_region(enabled)
    try:
        yield
    finally:
        torch.ops.tpserve_cpu.use_decode_region(True)


@needs_kernels
@pytest.mark.parametrize("path", ["region", "ops", "modules"])
@pytest.mark.parametrize("name", ["gqa_tied", "mqa_untied_bias", "qwen2_qkv_bias", "qwen3_qk_norm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_projections_give_the_float32_layers_logits_bit_for_bit(
        tiny_checkpoints: dict[str, Path], tmp_path: Path, name: str, dtype: torch.dtype, path: str) -> None:
    model_dir = save_cast(tiny_checkpoints[name], tmp_path / name, dtype)
    kept, runner, region_steps = _run(model_dir, True, path)
    widened, baseline, _ = _run(model_dir, False, path)
    layers, float_layers = _projections(runner), _projections(baseline)
    assert len(layers) == 4 * runner.config.num_hidden_layers
    assert all(m.weight.dtype == dtype for m in layers)
    assert all(m.weight.dtype == torch.float32 for m in float_layers)
    assert runner.model.model.embed_tokens.weight.dtype == dtype  # tied: the head's matrix; untied: its own rule
    if not runner.model.tie_word_embeddings:
        assert baseline.model.model.embed_tokens.weight.dtype == torch.float32
    for a, b in zip(layers, float_layers, strict=True):
        assert torch.equal(a.weight.float(), b.weight)
    assert weight_bytes(baseline.model) - weight_bytes(runner.model) >= sum(m.weight.numel() * 2 for m in layers)
    assert region_steps == (6 if path == "region" else 0)  # the 16-bit stack takes the one-region step
    for step, (a, b) in enumerate(zip(kept, widened, strict=True)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max()}"


@needs_kernels
def test_a_float32_checkpoints_layers_stay_float32_and_one_off_grid_layer_alone(tiny_checkpoints: dict[str, Path],
                                                                                 tmp_path: Path) -> None:
    runner = ModelRunner(tiny_checkpoints["gqa_tied"], ParallelContext.single(), torch.float32, 4)
    assert all(m.weight.dtype == torch.float32 for m in _projections(runner))  # float32 values: nothing rounded
    model_dir = save_cast(tiny_checkpoints["gqa_tied"], tmp_path / "bf16", torch.bfloat16)
    with mock.patch("worker.loader.takes_w16_layers", return_value=False):
        widened = ModelRunner(model_dir, ParallelContext.single(), torch.float32, 4)
    o_proj = widened.model.model.layers[0].self_attn.o_proj
    o_proj.weight.data[1, 2] += 1e-4  # off bfloat16's and float16's grids: that layer stays float32
    kept, released, embedding = keep_layers_16bit(widened.model)
    assert not embedding  # tied: the head's matrix, worker/lm_head_w16.py's
    layers = _projections(widened)
    assert kept == {torch.bfloat16: len(layers) - 1}
    assert released == sum(m.weight.numel() * 2 for m in layers if m is not o_proj)
    assert o_proj.weight.dtype == torch.float32
    assert all(m.weight.dtype == torch.bfloat16 for m in layers if m is not o_proj)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_checkpoints_projections_are_allocated_16_bit_before_loading(
        tiny_checkpoints: dict[str, Path], tmp_path: Path, dtype: torch.dtype) -> None:
    """The float32 copy never exists: each projection receives the stored values into a 16-bit weight (the values
    rule after loading, switched off here, is not what makes them 16-bit), and the logits are still the
    float32-widened model's (the values copied exactly)."""
    model_dir = save_cast(tiny_checkpoints["phi3_fused"], tmp_path / "phi3", dtype)  # q/k/v and gate/up stored fused
    received: list[torch.dtype] = []
    load_rows = linear_module._load_rows

    def recording(layer, param, *args, **kwargs):
        if param is layer.weight:
            received.append(param.dtype)
        return load_rows(layer, param, *args, **kwargs)

    with mock.patch("worker.layers_w16.sixteen_bit_dtype", return_value=None), \
            mock.patch.object(linear_module, "_load_rows", recording):
        runner = ModelRunner(model_dir, ParallelContext.single(), torch.float32, 4)
    layers = _projections(runner)
    assert all(m.weight.dtype == dtype for m in layers)
    assert received and set(received) == {dtype}  # column-parallel weights (qkv, gate_up) received into 16 bits
    with mock.patch("worker.loader.takes_w16_layers", return_value=False):
        widened = ModelRunner(model_dir, ParallelContext.single(), torch.float32, 4)
    for a, b in zip(layers, _projections(widened), strict=True):
        assert b.weight.dtype == torch.float32 and torch.equal(a.weight.float(), b.weight)
