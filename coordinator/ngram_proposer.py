"""Prompt lookup decoding: propose the tokens that followed the sequence's last n-gram before.

The proposer of ``--speculative-method ngram`` (Saxena 2023, "Prompt Lookup
Decoding", github.com/apoorvumang/prompt-lookup-decoding; vLLM's ``NgramProposer``).
For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, take the
sequence's last ``n`` tokens and find their most recent earlier occurrence
(prompt and output alike); the proposal is the ``k`` tokens that followed it,
read on past the end of the sequence as a copy (a match ``d`` tokens back
proposes a loop of period ``d``). The longest n-gram with a match wins; no match
proposes nothing.

Speculation only pays when the text repeats itself (code, summaries, quotes of
the input). :class:`coordinator.spec_decode.AdaptiveSpeculation` switches it off
per sequence while its proposals are mostly rejected, so a non-repetitive
workload does not pay for a k + 1 token verification step that yields one token.

Pure Python, no torch: the coordinator has the tokens. The search is
``bytes.rfind`` over the tokens packed as int32 (C speed, O(L) per n-gram).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tpserve.speculative_config import SpeculativeConfig

_ITEM = array("i").itemsize  # 4 bytes per token id


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` tokens by n-gram lookup in the sequence itself.

    Args:
        num_speculative_tokens: k, the most tokens proposed.
        prompt_lookup_min, prompt_lookup_max: the n-gram lengths tried, longest first.

    Raises:
        ValueError: ``k < 1``, ``prompt_lookup_min < 1`` or ``min > max``.
    """

    #: The proposal's tokens are known here (the draft model's are not: :class:`DraftModelProposer`).
    on_workers = False

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= "
                             f"prompt_lookup_max ({prompt_lookup_max})")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> tuple[int, ...]:
        """The proposal for the token after ``token_ids``.

        Args:
            token_ids: the sequence so far (prompt and output), token ids in [0, 2**31).
            max_tokens: propose at most this many (the room left before max_tokens or
                max_model_len); None: ``num_speculative_tokens``.

        Returns:
            Up to ``min(k, max_tokens)`` token ids, possibly none.
        """
        k = self.num_speculative_tokens if max_tokens is None else min(self.num_speculative_tokens, max_tokens)
        length = len(token_ids)
        if k <= 0 or length < self.prompt_lookup_min + 1:
            return ()
        haystack = array("i", token_ids).tobytes()
        for n in range(min(self.prompt_lookup_max, length - 1), self.prompt_lookup_min - 1, -1):
            start = _rfind_aligned(haystack, haystack[(length - n) * _ITEM:], length - 1)
            if start is None:
                continue
            # What followed the match, read on past the sequence's end as the copy it proposes:
            # a match d tokens back continues with period d (a loop proposes k tokens, not d).
            period = length - n - start
            proposal = []
            for position in range(start + n, start + n + k):
                while position >= length:
                    position -= period
                proposal.append(token_ids[position])
            return tuple(proposal)
        return ()


def _rfind_aligned(haystack: bytes, needle: bytes, end_token: int) -> int | None:
    """Token index of the last token-aligned occurrence of ``needle`` that ends before token ``end_token``.

    Ending before the sequence's last token excludes the suffix itself and leaves at
    least one token after the match to propose.
    """
    end = end_token * _ITEM
    while True:
        at = haystack.rfind(needle, 0, end)
        if at < 0:
            return None
        if at % _ITEM == 0:
            return at // _ITEM
        end = at + len(needle) - 1  # a match straddling token boundaries: look further left


class DraftModelProposer:
    """``--speculative-method draft``: the workers' draft model proposes (worker/draft_model.py).

    The coordinator only decides how many tokens each sequence may get proposed (the
    blocks and token budget they need are reserved like an n-gram proposal's); the
    tokens come back in the step's result with the verified ones.

    Args:
        num_speculative_tokens: k, the most tokens proposed.
    """

    on_workers = True

    def __init__(self, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens

    def num_to_propose(self, max_tokens: int) -> int:
        """How many tokens the draft proposes with room for ``max_tokens``."""
        return max(0, min(self.num_speculative_tokens, max_tokens))


def make_proposer(config: SpeculativeConfig) -> NgramProposer | DraftModelProposer | None:
    """The proposer ``config`` asks for (``--speculative-method``), or None when speculation is off."""
    if config.speculative_method is None:
        return None
    if config.speculative_method == "draft":
        return DraftModelProposer(config.num_speculative_tokens)
    low, high = config.lookup_range
    return NgramProposer(config.num_speculative_tokens, low, high)
