"""Sampling-control settings and their transformers reference, shared by the serving tests of each layout."""

from __future__ import annotations

import torch

from tests.paths import STORIES_DIR

EOS, MAX_TOKENS, MIN_TOKENS, PENALTY = 2, 40, 30, 1.3


def logits_of(ids: list[int]) -> torch.Tensor:
    """``(L, V)`` float32 transformers logits of every position of ``ids``."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(STORIES_DIR, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def reference(prompt: list[int], bias: dict[int, float]) -> list[int]:
    from transformers import (
        LlamaForCausalLM,
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    model = LlamaForCausalLM.from_pretrained(STORIES_DIR, torch_dtype=torch.float32).eval()
    processors = [SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]),
                  MinNewTokensLengthLogitsProcessor(len(prompt), MIN_TOKENS, EOS),
                  RepetitionPenaltyLogitsProcessor(PENALTY)]
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            scores = model(ids).logits[:, -1].float()  # (1, V)
            for processor in processors:
                scores = processor(ids, scores)
            token = int(scores.argmax())
            out.append(token)
            if token == EOS:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out
