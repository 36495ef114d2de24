"""Verification of proposed tokens on the worker: greedy exactness, reproducibility, the target distribution.

References: the stories260k goldens (made with ``transformers``) for greedy
verification; for sampling, the exact target distribution computed from the
model's logits (chi-squared goodness of fit) and the non-speculative sampler's
own draws over the same seeds (chi-squared homogeneity).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import TINY_MODELS, save_tiny_model
from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext
from worker.spec_verify import accept_proposals

GREEDY = SamplingParams(temperature=0.0)
BLOCK_SIZE = 4


def test_accept_proposals_keeps_the_matching_prefix_and_one_more() -> None:
    chunks = [ScheduledChunk(0, (5, 6, 7, 8), 10, num_spec_tokens=3),  # proposals 6, 7, 8
              ScheduledChunk(1, (9,), 3),                              # no proposals
              ScheduledChunk(2, (4, 4), 7, num_spec_tokens=1)]        # proposal 4
    # Chunk 0: targets 6, 7, 1 | 2 -> accepts 2, then the correction 1. Chunk 2: target 4 | bonus 3.
    tokens, accepted = accept_proposals(chunks, [2, 11, 3], [6, 7, 1, 4])
    assert tokens == (6, 7, 1, 11, 4, 3) and accepted == (2, 0, 1)
    tokens, accepted = accept_proposals(chunks[:1], [2], [0, 7, 8])  # first proposal rejected
    assert tokens == (0,) and accepted == (0,)
    with pytest.raises(ValueError, match="verification tokens"):
        accept_proposals(chunks[:1], [2], [6, 7])


@pytest.fixture(scope="module")
def stories_runner(stories_dir: Path) -> ModelRunner:
    runner = ModelRunner(stories_dir, ParallelContext.single(), torch.float32, block_size=BLOCK_SIZE)
    runner.init_kv_cache(num_blocks=64)
    return runner


def test_greedy_verification_gives_the_golden_tokens(stories_runner: ModelRunner, golden_lines: list[dict]) -> None:
    """Right proposals are all accepted (plus the bonus); a wrong one is replaced by the golden token."""
    runner, line = stories_runner, golden_lines[0]
    prompt, golden = tuple(line["prompt_token_ids"]), line["completion_token_ids"]
    blocks = tuple(range(8))
    first = runner.execute(StepPlan(0, (NewSequence(1, GREEDY, len(prompt)),), (ScheduledChunk(1, prompt, 0, blocks),)))
    assert first.sampled_token_ids == (golden[0],) and first.num_accepted_tokens == ()
    start = len(prompt)
    # Four right proposals after golden[0]: five tokens in one step.
    plan = StepPlan(1, scheduled=(ScheduledChunk(1, (golden[0], *golden[1:5]), start, num_spec_tokens=4),))
    result = runner.execute(plan)
    assert result.sampled_token_ids == tuple(golden[1:6]) and result.num_accepted_tokens == (4,)
    decode_logits = runner.last_logits
    # The third proposal wrong: two accepted, then the golden token in its place. The
    # rejected slots are rewritten by this chunk, as they will be after any rollback.
    start += 1 + 4
    wrong = (golden[6], golden[7], (golden[8] + 1) % 512)
    plan = StepPlan(2, trimmed_block_tables=((1, 3),),
                    scheduled=(ScheduledChunk(1, (golden[5], *wrong), start, (3, 4), num_spec_tokens=3),))
    result = runner.execute(plan)
    assert result.sampled_token_ids == tuple(golden[6:9]) and result.num_accepted_tokens == (2,)
    assert runner.last_spec_logits.shape == (3, 512) and decode_logits.shape == (1, 512)
    runner.execute(StepPlan(3, finished_seq_ids=(1,)))


def test_verified_rows_have_the_decode_logits(stories_runner: ModelRunner, golden_lines: list[dict]) -> None:
    """Each verification row's logits equal those of decoding that position one token at a time."""
    runner, line = stories_runner, golden_lines[1]
    prompt, golden = tuple(line["prompt_token_ids"]), line["completion_token_ids"]
    blocks = tuple(range(16, 24))
    runner.execute(StepPlan(0, (NewSequence(2, GREEDY, len(prompt)), NewSequence(3, GREEDY, len(prompt))),
                            (ScheduledChunk(2, prompt, 0, blocks[:4]), ScheduledChunk(3, prompt, 0, blocks[4:]))))
    start = len(prompt)
    runner.execute(StepPlan(1, scheduled=(ScheduledChunk(2, tuple(golden[:4]), start, num_spec_tokens=3),)))
    verified = torch.cat([runner.last_spec_logits, runner.last_logits])  # (4, V)
    decoded = []
    for offset in range(4):
        runner.execute(StepPlan(2 + offset, scheduled=(ScheduledChunk(3, (golden[offset],), start + offset),)))
        decoded.append(runner.last_logits)
    torch.testing.assert_close(verified, torch.cat(decoded), rtol=1e-5, atol=1e-5)
    runner.execute(StepPlan(9, finished_seq_ids=(2, 3)))


def test_invalid_speculative_chunks_are_refused(stories_runner: ModelRunner) -> None:
    new = (NewSequence(5, GREEDY),)
    with pytest.raises(ValueError, match="num_spec_tokens=2: needs sample and fewer than its 2 tokens"):
        stories_runner.execute(StepPlan(0, new, (ScheduledChunk(5, (1, 2), 0, (40,), num_spec_tokens=2),)))
    with pytest.raises(ValueError, match="num_spec_tokens=1: needs sample"):
        stories_runner.execute(StepPlan(1, new, (ScheduledChunk(5, (1, 2), 0, (40,), sample=False,
                                                                num_spec_tokens=1),)))
    with pytest.raises(ValueError, match="num_draft_tokens=2: needs a draft model"):
        stories_runner.execute(StepPlan(2, new, (ScheduledChunk(5, (1, 2), 0, (40,), num_draft_tokens=2),)))


# -- the target distribution of sampled requests -----------------------------------------------

NUM_SAMPLES = 2000
TOP_K = 8
TEMPERATURE = 2.0  # the tiny model is peaked: flatten it so every one of the top 8 expects >= 40 draws
#: chi-squared 0.999 quantile with 7 and 8 degrees of freedom (a fixed threshold: the seeds are fixed too).
CHI2_999 = {7: 24.322, 8: 26.124}


@pytest.fixture(scope="module")
def tiny_runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    spec = TINY_MODELS[0]
    directory = save_tiny_model(spec, tmp_path_factory.mktemp("spec") / spec.name)
    runner = ModelRunner(directory, ParallelContext.single(), torch.float32, block_size=BLOCK_SIZE)
    runner.init_kv_cache(num_blocks=NUM_SAMPLES // 4 + 1)
    return runner


def _first_tokens(runner: ModelRunner, prompt: tuple[int, ...],
                  proposal: int | None) -> tuple[list[int], list[int], torch.Tensor]:
    """The first output token of NUM_SAMPLES seeded requests (seed = index), verified or not; accepted
    counts; the ``(V,)`` logits of the token after the prompt."""
    tokens, accepted = [], []
    batch = NUM_SAMPLES // 4
    for start in range(0, NUM_SAMPLES, batch):
        seeds = range(start, start + batch)
        new = tuple(NewSequence(s, SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=s), len(prompt)) for s in seeds)
        feed = prompt + ((proposal,) if proposal is not None else ())
        chunks = tuple(ScheduledChunk(s, feed, 0, (s - start,), num_spec_tokens=int(proposal is not None))
                       for s in seeds)
        result = runner.execute(StepPlan(start, new, chunks, finished_seq_ids=tuple(range(max(start - batch, 0), start))))
        logits = runner.last_logits[0] if proposal is None else runner.last_spec_logits[0]
        counts = result.num_accepted_tokens or (0,) * batch
        flat = iter(result.sampled_token_ids)
        for count in counts:
            group = [next(flat) for _ in range(count + 1)]
            tokens.append(group[0])
            accepted.append(count)
    runner.execute(StepPlan(NUM_SAMPLES, finished_seq_ids=tuple(range(NUM_SAMPLES - batch, NUM_SAMPLES))))
    return tokens, accepted, logits


def test_sampled_verification_keeps_the_target_distribution(tiny_runner: ModelRunner) -> None:
    """Leviathan et al.'s rule with a one-hot proposal: the first token is still distributed as p."""
    prompt = (1, 5, 9)
    plain, _, logits = _first_tokens(tiny_runner, prompt, None)  # logits: the same for every seed
    top = logits.topk(TOP_K)
    target = dict(zip(top.indices.tolist(), (top.values / TEMPERATURE).softmax(-1).tolist()))  # top-k, temperature
    proposal = top.indices[1].item()  # the second most likely token: often accepted, often not
    verified, accepted, verified_logits = _first_tokens(tiny_runner, prompt, proposal)
    torch.testing.assert_close(verified_logits, logits, rtol=1e-5, atol=1e-5)

    # Acceptance of the proposal is Bernoulli(p(x)): within 4 standard deviations.
    p_x = target[proposal]
    rate = sum(accepted) / NUM_SAMPLES
    assert abs(rate - p_x) < 4 * (p_x * (1 - p_x) / NUM_SAMPLES) ** 0.5, (rate, p_x)
    assert 0.05 < p_x < 0.95  # both branches are exercised

    # Goodness of fit of the verified first token against p (df = 7), and of the plain sampler.
    for draws in (verified, plain):
        assert set(draws) <= set(target)  # top-k holds on the verification rows too
        chi2 = sum((draws.count(t) - NUM_SAMPLES * p) ** 2 / (NUM_SAMPLES * p) for t, p in target.items())
        assert chi2 < CHI2_999[TOP_K - 1], chi2
    # Homogeneity of verified vs plain draws (2 x 8 table, df = 7).
    chi2 = 0.0
    for t in target:
        row = (verified.count(t), plain.count(t))
        for observed in row:
            expected = sum(row) / 2
            chi2 += (observed - expected) ** 2 / expected if expected else 0.0
    assert chi2 < CHI2_999[TOP_K - 1], chi2
    # The same noise as the plain path: a seed gives the same first token with or without the proposal.
    same = sum(a == b for a, b in zip(verified, plain)) / NUM_SAMPLES
    assert same > 0.99, same


def test_a_seeded_verified_request_is_reproducible(tiny_runner: ModelRunner) -> None:
    prompt = (1, 17, 42)
    first = _first_tokens(tiny_runner, prompt, 3)[:2]
    assert _first_tokens(tiny_runner, prompt, 3)[:2] == first
