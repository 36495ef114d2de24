"""``tpserve serve`` of a DeepSeek V3 checkpoint (multi-head latent attention) at tp 2, every feature on.

The tiny seeded ``dsv3_moe`` checkpoint of tests/worker/deepseek_v3_specs.py (MLA with a low-rank
query, a dense layer then a sigmoid-routed MoE layer), at stories260k's vocabulary with its
tokenizer, served with ``--kv-cache-memory-bytes``, ngram speculative decoding and prefix caching:

* the pool is sized from the latent layout: ``GetModelInfo``'s ``num_kv_blocks`` is the budget
  over ``block_size x layers x (kv_lora_rank + qk_rope_head_dim) x 4`` bytes, and the ``serving``
  line says ``kv_cache_layout=latent:40``;
* greedy text equals ``transformers``' (40 tokens), twice (the second a prefix-cache hit), with
  the proposals verified through the latent cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.cluster import serve
from tests.paths import STORIES_DIR, requires_stories
from tests.tiny_models import load_hf_model, save_servable_model
from tests.worker.deepseek_v3_specs import MOE

pytestmark = [pytest.mark.e2e, requires_stories]

MAX_TOKENS = 40
BLOCK_SIZE = 16
#: Room for 50 blocks of the tiny model's latent cache: 2 layers x (32 + 8) float32 numbers per token.
BYTES_PER_BLOCK = BLOCK_SIZE * 2 * (32 + 8) * 4
BUDGET = 50 * BYTES_PER_BLOCK + 100
#: More than one block of tokens, so that the second request hits the first's cached latents.
PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


def test_mla_serves_with_a_latent_pool_speculation_and_prefix_hits(tmp_path: Path) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast

    model_dir = save_servable_model(MOE, tmp_path / "dsv3_moe", STORIES_DIR)
    model = load_hf_model(model_dir)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    want = out[0, len(prompt_ids):].tolist()
    log = tmp_path / "serve.log"
    with serve(model_dir, 2, "--kv-cache-memory-bytes", str(BUDGET), "--block-size", str(BLOCK_SIZE),
               "--speculative-method", "ngram", "--num-speculative-tokens", "2", "--prompt-lookup-max", "3",
               "--prompt-lookup-min", "1", log_path=log) as cluster:
        info = cluster.client.model_info()
        assert (info.num_kv_blocks, info.block_size) == (50, BLOCK_SIZE)
        cached = []
        for _ in range(2):
            result = cluster.client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            assert result.token_ids == want
            cached.append(result.usage.cached_prompt_tokens)
        assert len(prompt_ids) > BLOCK_SIZE and cached == [0, (len(prompt_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE]
    lines = [line for line in log.read_text(errors="replace").splitlines() if " serving " in line]
    assert len(lines) == 1 and "kv_cache_layout=latent:40" in lines[0] and "kv_cache_tokens=800" in lines[0], lines


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_mla_serves_with_an_8_bit_latent_cache(tmp_path: Path, kv_cache_dtype: str) -> None:
    """``--kv-cache-dtype int8|fp8`` at tp 2: the same budget holds (32 + 8) x 4 / (32 + 8 + 4) = 3.6 times the
    float32 blocks (codes and a per-token scale of the latent and of the rotated key:
    worker/layers/mla_attention.py), and the greedy tokens are a one-process tp 1 runner's with the same cache
    (the latent is replicated on every rank), also for the prefix-cache hit and under ngram speculation."""
    from tests.worker.kv8_helpers import eight_bit_runner, teacher_forced
    from transformers import PreTrainedTokenizerFast

    model_dir = save_servable_model(MOE, tmp_path / "dsv3_moe", STORIES_DIR)
    prompt_ids = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))(PROMPT)["input_ids"]
    want = teacher_forced(eight_bit_runner(model_dir, kv_cache_dtype), [prompt_ids], None, MAX_TOKENS)[0]
    with serve(model_dir, 2, "--kv-cache-memory-bytes", str(BUDGET), "--block-size", str(BLOCK_SIZE),
               "--kv-cache-dtype", kv_cache_dtype, "--speculative-method", "ngram", "--num-speculative-tokens", "2",
               "--prompt-lookup-max", "3", "--prompt-lookup-min", "1") as cluster:
        info = cluster.client.model_info()
        assert info.kv_cache_dtype == kv_cache_dtype
        assert info.num_kv_blocks == BUDGET // (BLOCK_SIZE * 2 * (32 + 8 + 4)) == 181  # float32: 50
        cached = []
        for _ in range(2):
            result = cluster.client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            assert list(result.token_ids) == want
            cached.append(result.usage.cached_prompt_tokens)
    assert cached == [0, (len(prompt_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE]


def test_mla_serves_int8_experts_at_tp_2(tmp_path: Path) -> None:
    """``--quantization int8`` on DeepSeek V3: the dense MLP and the shared and routed experts int8 per output
    channel, the attention float (worker/models/deepseek_v3.py); the greedy text equals ``transformers`` on the
    checkpoint holding those weights' int8 round trip (tests/worker/int8_checkpoints.py, from the definition)."""
    import re

    import torch

    from tests.worker.int8_checkpoints import save_dequantized
    from transformers import PreTrainedTokenizerFast

    model_dir = save_servable_model(MOE, tmp_path / "dsv3_moe", STORIES_DIR)
    reference = save_dequantized(model_dir, tmp_path / "int8_round_trip",
                                 re.compile(r"model\.layers\.\d+\.mlp\..*(gate_proj|up_proj|down_proj)\.weight$"))
    model = load_hf_model(reference)
    prompt_ids = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    want = out[0, len(prompt_ids):].tolist()
    with serve(model_dir, 2, "--quantization", "int8") as cluster:
        assert cluster.client.model_info().quantization == "int8"
        result = cluster.client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    assert list(result.token_ids) == want
