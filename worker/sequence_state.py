"""A rank's record of one running sequence, kept from step to step by the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpserve.step import SamplingParams
from worker.grammar import GrammarState


@dataclass
class SequenceState:
    """What a rank keeps of one running sequence between steps (worker/model_runner.py's ``_seqs``)."""

    sampling: SamplingParams
    block_table: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    history: list[int] | None = None  # every token so far; rank 0, sequences with a penalty or grammar only
    grammar_state: GrammarState | None = None  # rank 0, sequences with a grammar (worker/grammar.py)
    prompt_token_ids: tuple[int, ...] = ()  # only with prompt_logprobs (worker/logprobs.py)
    uses_logits_controls: bool = False  # sampling.uses_logits_controls, read once
    reports_logprobs: bool = False  # sampling.logprobs or prompt_logprobs: worker/logprobs.py has work
    tracks_history: bool = False  # history is not None
    last_token: int | None = None  # the sampling rank: the token sampled last (async scheduling's placeholder)
    lora_slot: int = 0  # its adapter's slot (worker/lora_adapters.py); 0: the base model
    state_slot: int = 0  # hybrid models: its live state slot (worker/state_cache.py)

    def __post_init__(self) -> None:
        self.uses_logits_controls = self.sampling.uses_logits_controls
        self.reports_logprobs = self.sampling.logprobs or self.sampling.prompt_logprobs is not None
        self.tracks_history = self.history is not None
