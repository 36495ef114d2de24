"""Benchmark workloads: which prompts to send and how many tokens to ask for.

- ``random`` (vLLM's random dataset): prompts of random token ids, sent as ids so no
  tokenizer is needed on the client. Lengths are drawn uniformly from
  [len * (1 - range_ratio), len * (1 + range_ratio)] (at least 1), for the prompt from
  ``input_len`` and for ``max_tokens`` from ``output_len``. End-of-sequence ids are never
  put in a prompt.
- ``jsonl``: one JSON object per line, ``{"prompt": "text" or [token ids], "max_tokens": N}``
  (``max_tokens`` optional: ``output_len`` then). Lines are used in file order,
  cycled when more requests are asked for than the file has.

Everything is seeded: the same arguments give the same requests.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One request to send: a text or token-id prompt and its ``max_tokens``."""

    prompt: str | list[int]
    max_tokens: int


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] of lengths drawn around ``length`` (vLLM's rule, at least 1).

    Raises:
        ValueError: length < 1 or range_ratio outside [0, 1).
    """
    if length < 1:
        raise ValueError(f"lengths must be >= 1 token, got {length}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    return max(1, int(length * (1 - range_ratio))), math.ceil(length * (1 + range_ratio))


def random_request(rng: random.Random, vocab_size: int, input_len: int, output_len: int, range_ratio: float,
                   excluded_ids: Sequence[int] = ()) -> SampleRequest:
    """One random token-id prompt and its max_tokens, drawn with ``rng``.

    Raises:
        ValueError: bad lengths or ratio (see :func:`length_range`), or no usable token id.
    """
    allowed = sorted(set(range(vocab_size)) - set(excluded_ids))
    if not allowed:
        raise ValueError(f"no token id in [0, {vocab_size}) is left to build prompts from")
    prompt_len = rng.randint(*length_range(input_len, range_ratio))
    max_tokens = rng.randint(*length_range(output_len, range_ratio))
    return SampleRequest([rng.choice(allowed) for _ in range(prompt_len)], max_tokens)


def random_requests(num_prompts: int, seed: int, vocab_size: int, input_len: int, output_len: int,
                    range_ratio: float, excluded_ids: Sequence[int] = ()) -> list[SampleRequest]:
    """``num_prompts`` random requests (see :func:`random_request`), reproducible from ``seed``."""
    rng = random.Random(seed)
    return [random_request(rng, vocab_size, input_len, output_len, range_ratio, excluded_ids)
            for _ in range(num_prompts)]


def load_jsonl(path: str | Path, default_max_tokens: int) -> list[SampleRequest]:
    """Every request in a JSONL file, in file order (blank lines skipped).

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not UTF-8 text, or a line is not JSON, lacks a non-empty "prompt", or has a
            max_tokens that is not a positive integer; the message names the file (and the line).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    requests = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        is_ids = isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
        if not prompt or not (isinstance(prompt, str) or is_ids):
            raise ValueError(f'{path}:{number}: "prompt" must be a non-empty string or list of token ids')
        max_tokens = row.get("max_tokens", default_max_tokens)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f'{path}:{number}: "max_tokens" must be a positive integer, got {max_tokens!r}')
        requests.append(SampleRequest(prompt, max_tokens))
    if not requests:
        raise ValueError(f"{path}: no requests in the file")
    return requests


def jsonl_requests(path: str | Path, num_prompts: int, default_max_tokens: int) -> list[SampleRequest]:
    """The file's first ``num_prompts`` requests, cycling through the file when it has fewer."""
    rows = load_jsonl(path, default_max_tokens)
    return [rows[i % len(rows)] for i in range(num_prompts)]
