"""Speculative decoding's configuration (the ``--speculative-*`` flags), one section of tpserve/config.py.

No torch here: the coordinator reads this too.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tpserve.config_base import INT32_MAX, FrozenSection


class SpeculativeConfig(FrozenSection):
    """Speculative decoding (vLLM's ``speculative_config`` keys, as flags).

    Attributes:
        speculative_method: None (off); "ngram": prompt lookup decoding, which proposes
            the tokens that followed the latest earlier occurrence of the sequence's last
            n-gram (coordinator/ngram_proposer.py; docs/design/scheduling.md, "Speculative decoding");
            "draft": a small model of the same tokenizer, run by the same ranks with its
            own KV cache, proposes greedily (worker/draft_model.py).
        speculative_model: with "draft", the draft model's checkpoint directory.
        num_speculative_tokens: most tokens proposed per sequence per step (k); required
            with a method.
        prompt_lookup_max, prompt_lookup_min: the n-gram lengths tried, longest first.
            vLLM's defaults: both 5 when neither is given, else the one given for both.
        speculative_disable_by_batch_size: no proposals in a step that runs more than
            this many sequences (vLLM's ``disable_by_batch_size``): a large batch is
            already compute-bound, and verifying k + 1 rows per sequence costs more than
            the accepted tokens gain; None: always speculate.

    Raises:
        ValueError: a method without ``num_speculative_tokens``, a lookup range that is
            empty or below 1, or ``speculative_model`` without "draft" (or the reverse).
    """

    speculative_method: Literal["ngram", "draft"] | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int | None = Field(None, ge=1, le=64)
    prompt_lookup_max: int | None = Field(None, ge=1, le=INT32_MAX)
    prompt_lookup_min: int | None = Field(None, ge=1, le=INT32_MAX)
    speculative_disable_by_batch_size: int | None = Field(None, ge=1, le=INT32_MAX)

    @model_validator(mode="after")
    def _check_lookup(self) -> SpeculativeConfig:
        if self.speculative_method is None:
            if self.num_speculative_tokens is not None or self.speculative_model is not None:
                raise ValueError("num_speculative_tokens and speculative_model need speculative_method (ngram or draft)")
            return self
        if self.num_speculative_tokens is None:
            raise ValueError(f"speculative_method={self.speculative_method} needs num_speculative_tokens (>= 1)")
        if self.speculative_method == "draft" and self.speculative_model is None:
            raise ValueError("speculative_method=draft needs speculative_model (the draft model's directory or hub id)")
        if self.speculative_method != "draft" and self.speculative_model is not None:
            raise ValueError(f"speculative_model (a draft model) is used only with speculative_method=draft, got "
                             f"speculative_method={self.speculative_method}: drop speculative_model, or draft with it")
        low, high = self.lookup_range
        if low > high:
            raise ValueError(f"prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
        return self

    @property
    def lookup_range(self) -> tuple[int, int]:
        """``(prompt_lookup_min, prompt_lookup_max)`` with vLLM's defaults filled in."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None:
            return (5, 5) if high is None else (high, high)
        return low, (high if high is not None else low)
