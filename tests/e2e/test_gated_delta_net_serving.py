"""``tpserve serve`` of the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5) at tp 1 and 2.

The tiny seeded checkpoints of tests/worker/hybrid_specs.py at stories260k's vocabulary, block size 16,
prompts prefilled in chunks of at most 24 tokens (``--max-num-batched-tokens``), states for 16 sequences:

* prompts of 1 to 5 blocks plus 2 tokens, each sent twice: both completions are ``transformers``' greedy ones,
  the second resuming from the state saved at the prompt's last whole block (its cached prompt tokens say so);
* 16 requests at once (every prompt again, and a copy sharing its first half): every completion the greedy one;
* the logprobs of the sampled tokens within 1e-4 of ``transformers``' (the checkpoints' DeltaNet queries are
  correlated with their keys, tests/tiny_models.py's ``_correlate_queries_with_keys``, as trained layers' are).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.cluster import serve
from tests.paths import STORIES_DIR, requires_stories
from tests.tiny_models import load_hf_model, save_servable_model
from tests.worker.hybrid_specs import QWEN3_5_SPEC, QWEN3_NEXT_SPEC

pytestmark = [pytest.mark.e2e, requires_stories]

MAX_TOKENS = 16
BLOCK_SIZE = 16


@pytest.fixture(scope="module", params=[QWEN3_NEXT_SPEC, QWEN3_5_SPEC], ids=lambda s: s.name)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_servable_model(request.param, tmp_path_factory.mktemp(request.param.name), STORIES_DIR)


def _greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), dim=-1)[t]) for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_tokens_prefix_states_and_16_at_once(model_dir: Path, tp: int) -> None:
    model = load_hf_model(model_dir)
    rng = random.Random(44)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(BLOCK_SIZE * n + 1)] for n in range(1, 6)]
    shared = [p[:len(p) // 2] + [rng.randrange(3, 512) for _ in range(5)] for p in prompts]
    want = [_greedy(model, p) for p in prompts]
    want_shared = [_greedy(model, p)[0] for p in shared]
    with serve(model_dir, tp, "--max-num-seqs", "16", "--max-num-batched-tokens", "24") as cluster:
        client = cluster.client
        for i, prompt in enumerate(prompts):
            miss, hit = (client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=True)
                         for _ in range(2))
            assert list(miss.token_ids) == list(hit.token_ids) == want[i][0], i
            assert (miss.usage.cached_prompt_tokens, hit.usage.cached_prompt_tokens) == (0, BLOCK_SIZE * (i + 1)), i
            assert max(abs(lp.logprob - ref) for lp, ref in zip(hit.logprobs, want[i][1])) < 1e-4
        assert cluster.metric("tpserve:prefix_cache_state_hits_total") >= len(prompts)
        requests = [*prompts, *shared, *prompts[:3], *shared[:3]]  # 16 at once
        with ThreadPoolExecutor(len(requests)) as pool:
            got = list(pool.map(lambda p: client.generate(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                                requests))
    expected = [*(w[0] for w in want), *want_shared, *(w[0] for w in want[:3]), *want_shared[:3]]
    assert [list(r.token_ids) for r in got] == expected
