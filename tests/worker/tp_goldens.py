"""The greedy goldens and prompts of the tensor-parallel runner tests and their checks, shared with the pipeline runner's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.worker.tp_harness import Job, StepRecord
from tpserve.step import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 64
GREEDY_PROMPTS = 8
GREEDY_TOKENS = 32
GREEDY_BLOCKS = 176  # 16 sequences of at most 12 + 32 tokens: 11 blocks of 4 each
GREEDY_SCORED = SamplingParams(temperature=0.0, prompt_logprobs=0)


@dataclass(frozen=True)
class Case:
    """A job and what rank 0 must report for it."""

    job: Job
    expected: list[list[tuple[int, int]]]  # per step: (seq_id, completion index) per sample
    completions: dict[int, list[int]]
    logits: dict[int, torch.Tensor] | None  # per seq_id: (num_new_tokens, vocab)
    prompt_logprobs: dict[int, torch.Tensor] | None = None  # per seq_id: (prompt length - 1,)


@torch.no_grad()
def _greedy_reference(model: torch.nn.Module, prompts: list[tuple[int, ...]]):
    """Per prompt: ``generate``'s 32 tokens, the logits that chose them (32, V), its prompt logprobs (P - 1,)."""
    completions, logits, prompt_logprobs = [], [], []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=GREEDY_TOKENS,
                             min_new_tokens=GREEDY_TOKENS, pad_token_id=0, eos_token_id=None)
        completion = out[0, len(prompt):].tolist()
        full = model(torch.tensor([list(prompt) + completion[:-1]])).logits[0].float()  # (P + 31, V)
        scores = torch.log_softmax(full[: len(prompt) - 1], dim=-1)  # (P - 1, V): rows scoring tokens 1 .. P-1
        completions.append(completion)
        logits.append(full[len(prompt) - 1:])
        prompt_logprobs.append(scores.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0])
    return completions, logits, prompt_logprobs


def _check_case(case: Case, records: list[StepRecord]) -> None:
    assert len(records) == len(case.expected)
    scored = {entry.seq_id: torch.tensor(entry.logprobs) for record in records for entry in record.prompt_logprobs
              if entry.first_position == 1}
    if case.prompt_logprobs is not None:
        assert scored.keys() == case.prompt_logprobs.keys()
        for seq_id, want in case.prompt_logprobs.items():
            torch.testing.assert_close(scored[seq_id], want, atol=1e-4, rtol=0, msg=lambda m: f"seq {seq_id}: {m}")
    for step, (record, samples) in enumerate(zip(records, case.expected, strict=True)):
        want_tokens = tuple(case.completions[seq_id][index] for seq_id, index in samples)
        assert record.sampled_token_ids == want_tokens, f"step {step}: samples {samples}"
        if not samples:
            assert record.logits is None
            continue
        if case.logits is not None:
            want = torch.stack([case.logits[seq_id][index] for seq_id, index in samples])  # (N, V)
            torch.testing.assert_close(record.logits, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
