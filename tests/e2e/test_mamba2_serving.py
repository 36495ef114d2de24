"""``tpserve serve`` of the Mamba-2 hybrids (Granite 4 hybrid, Nemotron-H) at tensor-parallel degree 2.

The tiny seeded checkpoints of tests/worker/hybrid_specs.py (Mamba chunk size 8) at stories260k's
vocabulary and tokenizer, served by two ranks with prompts prefilled in chunks of at most 24 tokens
(``--max-num-batched-tokens``), block size 16: eight prompts of 20 to 60 tokens sent 16 at once (each
twice, concurrently), then each again alone (a prefix hit resuming from a saved state), every
completion ``transformers``' greedy one; one request's logprobs within 1e-4 of ``transformers``'.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.cluster import serve
from tests.paths import STORIES_DIR, requires_stories
from tests.tiny_models import TinyModelSpec, load_hf_model, save_servable_model
from tests.worker.hybrid_specs import GRANITE_HYBRID_MOE, NEMOTRON_H

pytestmark = [pytest.mark.e2e, requires_stories]

MAX_TOKENS = 12
BLOCK_SIZE = 16


def _greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """``transformers``' greedy tokens and their log-probabilities."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), dim=-1)[t]) for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


@pytest.mark.parametrize("spec", [GRANITE_HYBRID_MOE, NEMOTRON_H], ids=lambda s: s.name)
def test_sixteen_at_once_then_prefix_hits_at_tp2(spec: TinyModelSpec, tmp_path: Path) -> None:
    model_dir = save_servable_model(spec, tmp_path / spec.name, STORIES_DIR)
    model = load_hf_model(model_dir)
    rng = random.Random(45)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(20, 61))] for _ in range(8)]
    want = [_greedy(model, p) for p in prompts]
    with serve(model_dir, 2, "--max-num-seqs", "16", "--max-num-batched-tokens", "24", "--block-size", str(BLOCK_SIZE),
               "--kv-cache-memory-bytes", str(16 << 20)) as cluster:  # room for every prompt's state checkpoints
        client = cluster.client

        def run(prompt: list[int]):
            return client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(run, prompts + prompts))
        for i, result in enumerate(together):
            assert list(result.token_ids) == want[i % 8][0], i
        for i, prompt in enumerate(prompts):
            again = run(prompt)
            assert list(again.token_ids) == want[i][0], i
            assert again.usage.cached_prompt_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE, i
        scored = client.generate(prompts[2], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=True)
        assert [lp.token_id for lp in scored.logprobs] == want[2][0]
        assert max(abs(lp.logprob - ref) for lp, ref in zip(scored.logprobs, want[2][1])) < 1e-4
