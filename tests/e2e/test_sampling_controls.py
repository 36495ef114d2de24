"""Sampling controls and logprobs end to end on stories260k at tensor-parallel degree 2, after a cached prefix.

The reference is a greedy loop over Hugging Face ``transformers``' logits with its own
processors applied in vLLM's order (SequenceBiasLogitsProcessor, then
MinNewTokensLengthLogitsProcessor, then RepetitionPenaltyLogitsProcessor, then the
argmax). The request shares two KV blocks with an earlier one, so the sampling rank
learns the cached tokens from the plan, never from a chunk: the repetition penalty
must count them all the same.
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.cluster import serve
from tests.e2e.sampling_reference import EOS, MAX_TOKENS, MIN_TOKENS, PENALTY, logits_of, reference
from tests.paths import STORIES_DIR, load_goldens, requires_stories

pytestmark = [pytest.mark.e2e, requires_stories]


# Multi-step: each of a plan's 4 steps counts the tokens sampled in the steps before it (penalties, min_tokens),
# and every token keeps its own logprobs.
@pytest.mark.parametrize("extra", [(), ("--async-scheduling",), ("--num-scheduler-steps", "4")],
                         ids=["sync", "async", "multi-step"])
def test_penalties_bias_and_min_tokens_after_a_cached_prefix_match_transformers(extra: tuple[str, ...]) -> None:
    golden = load_goldens()[0]
    prefix = golden["prompt_token_ids"] + golden["completion_token_ids"][:35]  # 40 tokens: 2 full blocks of 16
    prompt = prefix + [400, 428]
    bias = {286: 3.0, 432: -100.0}
    want = reference(prompt, bias)
    with serve(STORIES_DIR, 2, "--enable-prefix-caching", "--block-size", "16", *extra) as cluster:
        cluster.client.generate(prefix + [291], max_tokens=1, temperature=0)  # fills the cache
        result = cluster.client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, repetition_penalty=PENALTY,
                                         min_tokens=MIN_TOKENS, logit_bias=bias)
        sampled = cluster.client.generate(prompt, max_tokens=8, temperature=0.8, seed=1, presence_penalty=1.0,
                                          logprobs=True, top_logprobs=4)
        scored = cluster.client.generate(prompt, max_tokens=1, temperature=0, prompt_logprobs=2)
    got = result.token_ids + ([EOS] if result.finish_reason == "stop" else [])
    assert result.usage.cached_prompt_tokens == 32
    assert got == want
    assert len(want) > MIN_TOKENS and 432 not in want
    # Logprobs at tp 2: log_softmax of transformers' raw logits, whatever the temperature and penalty.
    raw = torch.log_softmax(logits_of(prompt + sampled.token_ids)[len(prompt) - 1:-1], dim=-1)  # (8, V)
    assert len(sampled.logprobs) == len(sampled.token_ids) == 8
    assert "".join(lp.text for lp in sampled.logprobs) == sampled.text  # each text as it reads in the text
    for row, (token, lp) in enumerate(zip(sampled.token_ids, sampled.logprobs, strict=True)):
        assert lp.token_id == token and lp.logprob == pytest.approx(float(raw[row, token]), abs=1e-4)
        top = raw[row].topk(4)
        assert [t.token_id for t in lp.top_logprobs] == top.indices.tolist()
        assert [t.logprob for t in lp.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    # Prompt logprobs at tp 2: the same distribution at every prompt position, no prefix cache.
    raw = torch.log_softmax(logits_of(prompt), dim=-1)  # (L, V)
    assert scored.usage.cached_prompt_tokens == 0 and len(scored.prompt_logprobs) == len(prompt) - 1
    for position, lp in enumerate(scored.prompt_logprobs, start=1):
        assert lp.token_id == prompt[position]
        assert lp.logprob == pytest.approx(float(raw[position - 1, prompt[position]]), abs=1e-4)
        assert [t.token_id for t in lp.top_logprobs] == raw[position - 1].topk(2).indices.tolist()
