"""``--kv-cache-dtype int8|fp8`` with multi-head latent attention (worker/layers/mla_attention.py): the latent and
rotated-key caches hold 8-bit codes with a per-token scale each, sized as 1 byte an element and 4 bytes a token;
the logits stay near the float cache's (tests/worker/test_kv_cache_dtype.py, its family specs); a prefix hit, a chunked prompt and a recomputed sequence read exactly
what a miss wrote; a latent model drafting for itself keeps its tokens with both caches 8-bit. Tiny DeepSeek-V3
checkpoints (tests/worker/deepseek_v3_specs.py; the reference for the float cache is transformers, in
tests/worker/test_deepseek_v3.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model
from tests.worker.deepseek_v3_specs import Q_LORA
from tests.worker.kv8_helpers import check_reads_match_a_miss, eight_bit_runner, greedy_through_scheduler, teacher_forced
from worker.kv_cache import KVCacheLayout
from worker.model_runner import ModelRunner

EIGHT_BIT = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(Q_LORA, tmp_path_factory.mktemp("mla_kv8") / Q_LORA.name)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_the_latent_pool_holds_codes_and_a_scale_per_token_of_each_tensor(model_dir: Path, kv_cache_dtype: str) -> None:
    """Per token and layer r + d_r one-byte codes and two bfloat16 scales: (2 (r + d_r)) / (r + d_r + 4) times a
    16-bit cache's blocks (r = 32, d_r = 8 here: 1.82x; DeepSeek-V3's 512 and 64: 1.99x)."""
    runner = eight_bit_runner(model_dir, kv_cache_dtype, num_blocks=8)
    half = KVCacheLayout.for_model(runner.config, 1, 16, torch.bfloat16)
    assert runner.kv_layout.bytes_per_block == 2 * 16 * (32 + 8 + 2 * 2) and half.bytes_per_block == 2 * 16 * 2 * 40
    assert {t.dtype for pair in runner.kv_caches for t in pair} == {EIGHT_BIT[kv_cache_dtype]}
    scaled = runner._latent_layers
    assert len(scaled) == 2 and runner.kv_scales == []  # no per-head layer, no key offset
    for latent_scale, rope_scale in (attn.kv_scales for attn in scaled):
        assert latent_scale.shape == rope_scale.shape == (8, 1, 16) and latent_scale.dtype == torch.bfloat16
    tensors = runner.block_tensors()  # what the host tier and a KV transfer copy: codes, then the scale pools
    assert len(tensors) == 4 and sum(t[0].numel() * t.element_size() for pair in tensors for t in pair) \
        == runner.kv_layout.bytes_per_block
    assert runner.kv_codec == str(EIGHT_BIT[kv_cache_dtype]).removeprefix("torch.")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_prefix_hits_chunks_and_recomputation_read_what_a_miss_wrote(model_dir: Path, kv_cache_dtype: str) -> None:
    """The 8-bit latent cache read four ways gives a miss's logits: a prefix hit, a chunked prompt (its history
    gathered through the block table), a recomputed prompt, and decode steps (absorbed, over the codes) against
    one prefill of prompt and output (expanded, its own rows as cached): kv8_helpers' ``check_reads_match_a_miss``."""
    check_reads_match_a_miss(eight_bit_runner(model_dir, kv_cache_dtype))


def test_a_latent_model_drafting_for_itself_keeps_its_tokens_with_8_bit_caches(model_dir: Path) -> None:
    """``--speculative-method draft`` with both caches 8-bit (worker/draft_model.py): the scheduler's greedy
    tokens are the same cache's without speculation, and a draft that reads its own codes right proposes what
    the target accepts."""
    from coordinator.ngram_proposer import DraftModelProposer
    from worker.parallel_state import ParallelContext

    prompts = [list(range(3, 23)), [1, 7, 9, 11, 13], list(range(40, 77))]
    want = teacher_forced(eight_bit_runner(model_dir, "int8"), prompts, None, 16)
    runner = ModelRunner(model_dir, ParallelContext.single(), torch.float32, 16, draft_model_dir=model_dir,
                         kv_cache_dtype="int8")
    runner.init_kv_cache(48)
    assert runner.draft is not None and len(runner.draft.latent_layers) == 2
    outputs, scheduler = greedy_through_scheduler(runner, prompts, 16, 48, 190, DraftModelProposer(3))
    assert outputs == want
    assert scheduler.spec.num_drafts > 5
    assert scheduler.spec.num_accepted_tokens > 0.9 * scheduler.spec.num_draft_tokens, scheduler.spec

