"""ModelRunner in one process: start-up errors, plan validation, sizing, half precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import load_hf_model
from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runner(stories_dir: Path) -> ModelRunner:
    runner = ModelRunner(stories_dir, ParallelContext.single(), torch.float32, block_size=4)
    runner.init_kv_cache(num_blocks=8)
    return runner


def test_model_that_cannot_be_split_is_refused_naming_the_dimension(stories_dir: Path) -> None:
    ctx = ParallelContext(tp_rank=0, tp_size=8, device=torch.device("cpu"))  # checked before any collective
    with pytest.raises(ValueError, match="intermediate_size=172 is not divisible by tensor_parallel_size=8"):
        ModelRunner(stories_dir, ctx, torch.float32, block_size=16)


def test_unsupported_dtype_is_refused(stories_dir: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        ModelRunner(stories_dir, ParallelContext.single(), torch.float64, block_size=16)


def test_execute_before_init_kv_cache_is_an_error(stories_dir: Path) -> None:
    runner = ModelRunner(stories_dir, ParallelContext.single(), torch.float32, block_size=16)
    with pytest.raises(RuntimeError, match="init_kv_cache"):
        runner.execute(StepPlan(0))


def test_num_blocks_for_memory(runner: ModelRunner) -> None:
    # 5 layers * (K and V) * 4 tokens * 4 KV heads * 8 dims * 4 bytes = 5120 bytes per block.
    assert runner.kv_layout.bytes_per_block == 5120
    assert runner.num_blocks_for_memory(1 << 20) == (1 << 20) // 5120
    assert runner.num_blocks_for_memory(5119) == 0


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (StepPlan(1, scheduled=(ScheduledChunk(99, (5,), 0, (0,)),)), "seq_id=99 is not known"),
        (StepPlan(2, (NewSequence(7, GREEDY),), (ScheduledChunk(7, (1, 2, 3, 4, 5), 0, (0,)),)), "needs 5 KV slots"),
        (StepPlan(3, (NewSequence(7, GREEDY),), (ScheduledChunk(7, (1,), 0, (8,)),)), r"block ids \[8\] outside"),
        (StepPlan(4, (NewSequence(7, GREEDY),), (ScheduledChunk(7, (1,), 0, (0,)), ScheduledChunk(7, (2,), 1))),
         "scheduled twice"),
    ],
)
def test_invalid_plans_are_refused(runner: ModelRunner, plan: StepPlan, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        runner.execute(plan)


def test_empty_and_non_sampling_steps(runner: ModelRunner) -> None:
    assert runner.execute(StepPlan(10)).sampled_token_ids == ()
    plan = StepPlan(11, (NewSequence(20, GREEDY),), (ScheduledChunk(20, (1, 403, 407), 0, (1,), sample=False),))
    result = runner.execute(plan)
    assert result.step_id == 11 and result.sampled_token_ids == () and runner.last_logits is None
    num_sequences = runner.num_sequences
    runner.execute(StepPlan(12, finished_seq_ids=(20,)))
    assert runner.num_sequences == num_sequences - 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_as_close_to_float32_as_transformers(
    stories_dir: Path, golden_lines: list[dict], dtype: torch.dtype
) -> None:
    """Our half-precision logits stray from float32 no more than ``transformers``' own do."""
    line = golden_lines[0]
    ids = line["prompt_token_ids"] + line["completion_token_ids"][:11]  # 16 tokens
    runner = ModelRunner(stories_dir, ParallelContext.single(), dtype, block_size=4)
    runner.init_kv_cache(num_blocks=8)
    seq = NewSequence(0, GREEDY)
    runner.execute(StepPlan(0, (seq,), (ScheduledChunk(0, tuple(ids[:12]), 0, (3, 1, 4)),)))  # prefill
    result = runner.execute(StepPlan(1, scheduled=(ScheduledChunk(0, tuple(ids[12:]), 12, (6,)),)))  # chunk
    ours = runner.last_logits[0]  # (V,) float32
    with torch.no_grad():
        ref32 = load_hf_model(stories_dir)(torch.tensor([ids])).logits[0, -1].float()  # (V,)
        ref_half = load_hf_model(stories_dir, dtype)(torch.tensor([ids])).logits[0, -1].float()  # (V,)
    hf_error = float((ref_half - ref32).abs().max())
    our_error = float((ours - ref32).abs().max())
    assert our_error <= 2 * hf_error + 1e-2, (our_error, hf_error)
    assert result.sampled_token_ids == (int(ref32.argmax()),)
