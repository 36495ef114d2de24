"""logit_bias, min_tokens, penalties and min_p against transformers' logits processors.

Where transformers has the processor (RepetitionPenaltyLogitsProcessor, MinPLogitsWarper,
SequenceBiasLogitsProcessor, MinNewTokensLengthLogitsProcessor) it is the reference;
presence and frequency penalties (which transformers lacks) are checked against
OpenAI's formula written out per token. Then through the real ModelRunner on
stories260k: two requests with different penalties in one batch each give the
tokens of their solo run, also when one starts after a cached prefix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TypicalLogitsWarper,
)

from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.logits_processors import SampledRow, apply_min_p, build_processors, with_processors
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext
from worker.sampler import SamplingTensors, sample_tensors

VOCAB = 40


def rows(seed: int = 0, n: int = 3) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3  # (n, V)


def histories(n: int = 3, length: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (length,), generator=gen).tolist() for _ in range(n)]


def apply_processors(logits: torch.Tensor, rows: list[SampledRow]) -> torch.Tensor:
    """The processors before the temperature, as the sampler applies them (on a copy)."""
    out = logits.clone()
    for processor in build_processors(rows, "cpu"):
        if not processor.after_temperature:
            out = processor.apply(out)
    return out


def controlled(logits: torch.Tensor, params: list[SamplingParams], num_prompt: int = 5) -> torch.Tensor:
    hist = histories(len(params))
    return apply_processors(logits, [SampledRow(p, num_prompt, len(h), h) for p, h in zip(params, hist)])


def test_repetition_penalty_matches_transformers_on_prompt_and_output() -> None:
    logits, hist = rows(), histories()
    params = [SamplingParams(repetition_penalty=r) for r in (1.3, 0.7, 1.0)]
    got = controlled(logits, params)
    for row, p in enumerate(params):
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([hist[row]]), logits[row:row + 1])
        torch.testing.assert_close(got[row:row + 1], want, rtol=0, atol=0)


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits, hist = rows(2), histories()
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams(frequency_penalty=-1.5),
              SamplingParams(presence_penalty=2.0)]
    got = controlled(logits, params, num_prompt=5)
    want = logits.clone()
    for row, p in enumerate(params):
        output = hist[row][5:]
        for token in range(VOCAB):
            count = output.count(token)
            want[row, token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_logit_bias_matches_transformers_sequence_bias() -> None:
    logits = rows(3)
    bias = ((3, 5.0), (7, -100.0), (39, 0.5))
    got = controlled(logits, [SamplingParams(logit_bias=bias), SamplingParams(), SamplingParams(logit_bias=((0, 1.0),))])
    want0 = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias])(torch.tensor([[1, 2]]), logits[:1].clone())
    torch.testing.assert_close(got[:1], want0)
    torch.testing.assert_close(got[1], logits[1])
    assert got[2, 0] == logits[2, 0] + 1.0


def test_min_tokens_matches_transformers_min_new_tokens() -> None:
    logits, stop_ids = rows(4, n=1), (2, 9)
    params = SamplingParams(min_tokens=4, min_tokens_stop_ids=stop_ids)
    for generated in range(6):  # 5 prompt tokens, then `generated` outputs
        pos = 5 + generated
        reference = MinNewTokensLengthLogitsProcessor(5, 4, list(stop_ids))
        want = reference(torch.zeros(1, pos, dtype=torch.long), logits.clone())
        got = apply_processors(logits, [SampledRow(params, 5, pos)])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert (got[0, 2] == float("-inf")) == (generated < 4)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_matches_transformers_warper(min_p: float) -> None:
    scaled = rows(5) / 0.7
    want = MinPLogitsWarper(min_p)(torch.zeros(3, 1, dtype=torch.long), scaled.clone())
    torch.testing.assert_close(apply_min_p(scaled, torch.full((3,), min_p)), want, rtol=0, atol=0)


@pytest.mark.parametrize("typical_p", [0.2, 0.5, 0.9, 0.99])
def test_typical_p_matches_transformers_warper(typical_p: float) -> None:
    # Rows of several spreads, one with a -inf (an earlier processor's ban), after temperature 0.7.
    scaled = torch.cat([rows(7, n=3), rows(8, n=3) * 0.2, rows(9, n=2) * 4]) / 0.7  # (8, V)
    scaled[2, 5] = float("-inf")
    params = SamplingParams(temperature=0.7, typical_p=typical_p, seed=1)
    (processor,) = build_processors([SampledRow(params, 5, 9)] * 8, "cpu")
    want = TypicalLogitsWarper(typical_p)(torch.zeros(8, 1, dtype=torch.long), scaled.clone())
    torch.testing.assert_close(processor.apply(scaled.clone()), want, rtol=0, atol=0)
    assert processor.after_temperature


def test_typical_p_samples_only_typical_tokens_and_leaves_other_rows() -> None:
    logits = (rows(10, n=1) * 0.3).expand(400, -1)  # (400, V) one flat distribution, 400 positions
    typical = SamplingParams(temperature=1.0, typical_p=0.3, seed=3)
    kept = TypicalLogitsWarper(0.3)(torch.zeros(1, 1, dtype=torch.long), logits[:1].clone())[0] > float("-inf")
    assert 1 < int(kept.sum()) < VOCAB
    tensors = SamplingTensors.from_params([typical] * 400, list(range(1, 401)), "cpu")
    states = [_State(typical, None)] * 400
    chunks = [ScheduledChunk(i, (1,), i) for i in range(400)]  # row i samples position i + 1
    tokens = sample_tensors(logits, with_processors(tensors, chunks, states, "cpu"))
    assert kept[tokens].all() and len(set(tokens.tolist())) == int(kept.sum())  # every typical token drawn
    untouched = SamplingParams(temperature=1.0, seed=3)  # the same seed without typical_p: the whole vocabulary
    plain = sample_tensors(logits, SamplingTensors.from_params([untouched] * 400, list(range(1, 401)), "cpu"))
    assert not kept[plain].all()


class _State:
    def __init__(self, sampling: SamplingParams, history: list[int] | None) -> None:
        self.sampling, self.num_prompt_tokens, self.history, self.grammar_state = sampling, 0, history, None


def test_sampler_applies_controls_in_vllm_order_and_only_where_asked() -> None:
    logits = rows(6, n=2)
    hist = histories(2)
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias=((11, 4.0),))
    plain = SamplingParams(temperature=0.0)
    tensors = SamplingTensors.from_params([penalized, plain], [12, 12], "cpu")
    chunks = [ScheduledChunk(0, (hist[0][-1],), 11), ScheduledChunk(1, (hist[1][-1],), 11)]

    class State:
        def __init__(self, sampling: SamplingParams, history: list[int] | None) -> None:
            self.sampling, self.num_prompt_tokens, self.history, self.grammar_state = sampling, 5, history, None

    assert with_processors(tensors, chunks, [State(plain, None)] * 2, "cpu") is tensors  # nothing to pay
    with_controls = with_processors(tensors, chunks, [State(penalized, hist[0]), State(plain, None)], "cpu")
    tokens = sample_tensors(logits, with_controls)
    biased = logits[0].clone()
    biased[11] += 4.0
    want = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([hist[0]]), biased[None])[0].argmax()
    assert tokens.tolist() == [int(want), int(logits[1].argmax())]


# -- through the model runner: a request's penalties apply to its own row only ---------------------


@pytest.fixture(scope="module")
def runner(stories_dir: Path) -> ModelRunner:
    runner = ModelRunner(stories_dir, ParallelContext.single(), torch.float32, block_size=4)
    runner.init_kv_cache(num_blocks=64)
    return runner


A = SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.6)
B = SamplingParams(temperature=0.8, seed=5, presence_penalty=1.5, min_p=0.1, min_tokens=3, min_tokens_stop_ids=(2,))
PROMPT_A = [1, 403, 407, 261, 378, 30, 16, 19]
PROMPT_B = [1, 403, 407, 261, 378, 30, 16, 19, 272, 31]  # shares 2 blocks of 4 with A


def decode(runner: ModelRunner, specs: list[tuple[int, SamplingParams, list[int], list[int], int]], steps: int,
           step_id: int) -> dict[int, list[int]]:
    """Runs ``specs`` (seq_id, sampling, prompt, block ids, cached tokens) together for ``steps`` tokens each."""
    new = tuple(NewSequence(sid, params, len(prompt), tuple(prompt[:cached]) if params.uses_token_history else ())
                for sid, params, prompt, _, cached in specs)
    chunks = tuple(ScheduledChunk(sid, tuple(prompt[cached:]), cached, tuple(blocks)) for sid, _, prompt, blocks, cached in specs)
    outputs: dict[int, list[int]] = {sid: [] for sid, *_ in specs}
    plan = StepPlan(step_id, new, chunks)
    for n in range(steps):
        result = runner.execute(plan)
        for (sid, *_), token in zip(specs, result.sampled_token_ids, strict=True):
            outputs[sid].append(token)
        lengths = {sid: len(prompt) + len(outputs[sid]) for sid, _, prompt, _, _ in specs}
        plan = StepPlan(step_id + n + 1, (), tuple(ScheduledChunk(sid, (outputs[sid][-1],), lengths[sid] - 1)
                                                   for sid, *_ in specs))
    runner.execute(StepPlan(step_id + steps + 1, finished_seq_ids=tuple(sid for sid, *_ in specs)))
    return outputs


def test_two_requests_with_different_penalties_in_one_batch_equal_their_solo_runs(runner: ModelRunner) -> None:
    blocks_a, blocks_b = list(range(0, 8)), list(range(8, 16))
    solo_a = decode(runner, [(0, A, PROMPT_A, blocks_a, 0)], 12, 0)[0]
    solo_b = decode(runner, [(1, B, PROMPT_B, blocks_b, 0)], 12, 100)[1]
    plain = decode(runner, [(2, SamplingParams(temperature=0.0), PROMPT_A, blocks_a, 0)], 12, 200)[2]
    assert solo_a != plain  # the penalties change the greedy tokens
    both = decode(runner, [(3, A, PROMPT_A, blocks_a, 0), (4, B, PROMPT_B, blocks_b, 0)], 12, 300)
    assert both == {3: solo_a, 4: solo_b}
    # B again, starting after A's first 2 blocks (a cached prefix): its history comes in NewSequence.
    warm = decode(runner, [(5, A, PROMPT_A, blocks_a, 0)], 1, 400)
    assert warm[5] == solo_a[:1]
    cached = decode(runner, [(6, B, PROMPT_B, blocks_a[:2] + blocks_b[2:], 8)], 12, 500)
    assert cached[6] == solo_b
