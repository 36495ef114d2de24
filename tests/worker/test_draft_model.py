"""``--speculative-method draft`` in one process: the real scheduler driving a ModelRunner with a draft model.

References: the stories260k goldens (Hugging Face ``transformers``, no speculation),
token for token. Two drafts: stories260k itself (its greedy proposals are the
target's own tokens, so nearly all are accepted: a wrong draft K/V would show as
rejections) and a seeded random tiny model of the same vocabulary (nearly all
rejected: the rollback path).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordinator.block_allocator import BlockAllocator
from coordinator.ngram_proposer import DraftModelProposer
from coordinator.scheduler import Scheduler
from coordinator.sequence import Sequence, StopParams
from tests.tiny_models import TinyModelSpec, save_tiny_model
from tpserve.step import SamplingParams
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext

BLOCK_SIZE = 8
NUM_BLOCKS = 160
RANDOM_DRAFT = TinyModelSpec("draft512", "llama", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "vocab_size": 512, "tie_word_embeddings": True}, seed=7)


@pytest.fixture(scope="module")
def random_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(RANDOM_DRAFT, tmp_path_factory.mktemp("draft") / RANDOM_DRAFT.name)


def serve_goldens(runner: ModelRunner, lines: list[dict], proposer: DraftModelProposer) -> tuple[list, Scheduler]:
    """The lines through the scheduler and the runner, line i arriving at step i; their output token ids."""
    scheduler = Scheduler(BlockAllocator(NUM_BLOCKS, BLOCK_SIZE), max_num_seqs=16, max_num_batched_tokens=256,
                          enable_prefix_caching=True, check_writes=True, proposer=proposer)
    seqs = [Sequence(i, list(line["prompt_token_ids"]), SamplingParams(temperature=0.0),
                     StopParams(line["max_tokens"], frozenset({2})), 512) for i, line in enumerate(lines)]
    step = 0
    while scheduler.has_work() or step < len(seqs):
        if step < len(seqs):
            scheduler.add(seqs[step])
        step += 1
        plan = scheduler.schedule()
        scheduler.update(plan, runner.execute(plan))
        scheduler.check_invariants()
    runner.execute(scheduler.schedule())  # the last drops
    assert runner.num_sequences == 0 and scheduler.allocator.num_free_blocks == NUM_BLOCKS
    return [seq.output_token_ids for seq in seqs], scheduler


def expected(line: dict) -> list[int]:
    return line["completion_token_ids"] + ([2] if line["finish_reason"] == "stop" else [])


def continued(line: dict, num_tokens: int) -> dict:
    """The golden with its first ``num_tokens`` completion tokens moved into the prompt (greedy: same rest)."""
    return {**line, "prompt_token_ids": line["prompt_token_ids"] + line["completion_token_ids"][:num_tokens],
            "completion_token_ids": line["completion_token_ids"][num_tokens:], "max_tokens": line["max_tokens"] - num_tokens}


@pytest.mark.parametrize("draft", ["self", "random"])
def test_greedy_output_with_a_draft_model_is_the_golden(stories_dir: Path, golden_lines: list[dict],
                                                        random_draft_dir: Path, draft: str) -> None:
    runner = ModelRunner(stories_dir, ParallelContext.single(), torch.float32, BLOCK_SIZE,
                         draft_model_dir=stories_dir if draft == "self" else random_draft_dir)
    runner.init_kv_cache(NUM_BLOCKS)
    # Long repeated prompts: later ones start from cached blocks, whose draft K/V must be right too.
    lines = golden_lines + [continued(golden_lines[i % 2], 24) for i in range(4)]
    outputs, scheduler = serve_goldens(runner, lines, DraftModelProposer(4))
    assert outputs == [expected(line) for line in lines]
    stats = scheduler.spec
    assert stats.num_drafts > 50 and scheduler.prefix_cache_hits > 0
    if draft == "self":  # its own greedy tokens: rejected only where batch numerics differ, if ever
        assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens, stats
    else:
        assert stats.num_accepted_tokens < 0.5 * stats.num_draft_tokens, stats
    assert runner.kv_layout.bytes_per_block == runner._target_layout.bytes_per_block + runner.draft.kv_layout.bytes_per_block


def test_a_draft_of_another_vocabulary_is_refused(stories_dir: Path, tmp_path: Path) -> None:
    spec = TinyModelSpec("draft300", "llama", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                               "vocab_size": 300}, seed=8)
    draft_dir = save_tiny_model(spec, tmp_path / spec.name)
    with pytest.raises(ValueError, match="vocab_size=300; the target has 512"):
        ModelRunner(stories_dir, ParallelContext.single(), torch.float32, BLOCK_SIZE, draft_model_dir=draft_dir)
    # The coordinator refuses it before starting any rank.
    from launch.leader import Leader
    from launch.startup import StartupError
    from tpserve.config import ClusterConfig

    config = ClusterConfig.load_from(None, {"load": {"model": str(stories_dir)}, "speculative": {
        "speculative_method": "draft", "speculative_model": str(draft_dir), "num_speculative_tokens": 2}})
    with pytest.raises(StartupError, match="has vocab_size=300, the model 512: a draft model must share"):
        Leader(config)
