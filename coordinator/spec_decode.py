"""Speculative decoding's bookkeeping in the coordinator: the per-sequence switch-off and the counters.

The proposer is :mod:`coordinator.ngram_proposer`; the scheduler asks it for
proposals and feeds every verified one to the sequence's :class:`AdaptiveSpeculation`
and to its :class:`SpecDecodeStats` (the ``tpserve:spec_decode_*`` metrics). No torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(slots=True)
class AdaptiveSpeculation:
    """Per sequence: speculate while proposals are accepted often enough, else pause.

    The acceptance of each verified proposal (accepted / proposed tokens) feeds an
    exponential moving average; when it falls below ``min_acceptance`` the sequence
    stops speculating for ``pause`` output tokens, and each further pause doubles,
    up to ``max_pause``. Rationale: on a CPU or a small batch a step verifying k + 1
    tokens costs little more than a decode, but not nothing; a rate of 0.2 already
    gains about 0.2 k tokens per step, below that the extra rows are waste.

    Attributes:
        ewma: the moving average of the acceptance rate, starting optimistic (1).
        resume_at: the output length at which speculation resumes (0: not paused).
        pause: the next pause's length in output tokens.
        min_acceptance: the average below which it pauses (0: never).
        counted_from, num_counted: the output position (tokens) where its last verified proposal's
            tokens begin, and how many of them :class:`SpecDecodeStats` counted accepted: a stop string
            found among them later takes back those past it (:meth:`SpecDecodeStats.take_back`).
    """

    ewma: float = 1.0
    resume_at: int = 0
    pause: int = 16
    min_acceptance: float = 0.2
    counted_from: int = 0
    num_counted: int = 0

    WEIGHT = 0.3  # of the newest proposal in the average: about the last 3 to 5 count
    MAX_PAUSE = 512

    def allowed(self, num_output_tokens: int) -> bool:
        """Whether the sequence may speculate now."""
        return num_output_tokens >= self.resume_at

    def record(self, num_proposed: int, num_accepted: int, num_output_tokens: int) -> None:
        """Feeds one verified proposal; may start a pause."""
        if num_proposed <= 0:
            return
        self.ewma += self.WEIGHT * (num_accepted / num_proposed - self.ewma)
        if self.ewma < self.min_acceptance:
            self.resume_at = num_output_tokens + self.pause
            self.pause = min(2 * self.pause, self.MAX_PAUSE)
            self.ewma = 0.5  # on resuming, two bad proposals in a row pause it again


@dataclass(slots=True)
class SpecDecodeStats:
    """Speculative decoding's cumulative counters (the ``tpserve:spec_decode_*`` metrics).

    Attributes:
        num_drafts: proposals verified (one per sequence per step that had one).
        num_draft_tokens: tokens proposed in them.
        num_accepted_tokens: proposed tokens accepted and kept (none past a stop: those are
            thrown away, so they count as proposed, not accepted).
        draft_tokens_per_pos, accepted_tokens_per_pos: the same two counts by position
            in the proposal (0 is the first proposed token); acceptance at position i
            is ``accepted_tokens_per_pos[i] / draft_tokens_per_pos[i]``.
    """

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_tokens_per_pos: list[int] = field(default_factory=list)
    accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.draft_tokens_per_pos = self.draft_tokens_per_pos or [0] * self.num_speculative_tokens
        self.accepted_tokens_per_pos = self.accepted_tokens_per_pos or [0] * self.num_speculative_tokens

    def snapshot(self) -> SpecDecodeStats:
        """A copy of the counters now."""
        return dataclasses.replace(self, draft_tokens_per_pos=list(self.draft_tokens_per_pos),
                                   accepted_tokens_per_pos=list(self.accepted_tokens_per_pos))

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """Counts one verified proposal of ``num_proposed`` tokens whose first ``num_accepted`` were accepted and kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for pos in range(num_proposed):
            self.draft_tokens_per_pos[pos] += 1
            self.accepted_tokens_per_pos[pos] += pos < num_accepted

    def take_back(self, speculation: AdaptiveSpeculation, num_output_tokens: int) -> None:
        """A stop string cut a sequence's output to its first ``num_output_tokens`` tokens: its last verified
        proposal's accepted tokens past that (``speculation.counted_from``, ``.num_counted``) were thrown away,
        so they now count as proposed only. The scheduler counts a proposal when it applies it, before the
        text (and so a stop string) is known; an older proposal, wholly before the cut, loses nothing."""
        first_dropped = max(num_output_tokens - speculation.counted_from, 0)  # position in that proposal
        for pos in range(first_dropped, speculation.num_counted):
            self.accepted_tokens_per_pos[pos] -= 1
            self.num_accepted_tokens -= 1
        speculation.num_counted = min(speculation.num_counted, first_dropped)
