"""llguidance set up the same way on the coordinator and on the sampling rank.

The coordinator compiles every grammar, in a separate process and under a time
limit (coordinator/grammar_compiler.py), exactly as rank 0 will build it
(worker/grammar.py): the same tokenizer and the same parser limits. A grammar the
coordinator accepted therefore builds on the rank too, in about the time it took the
coordinator, which the time limit bounds. No torch.
"""

from __future__ import annotations

import json
from pathlib import Path

#: llguidance's own resource limits (``LLParserLimits``), the library's defaults made
#: explicit and shared by both sides; ``verbose_errors`` off so a refusal quotes no
#: parser state (grammar internals) back to the caller.
PARSER_LIMITS = dict(
    max_items_in_row=2000,  # branching of one grammar row
    initial_lexer_fuel=1_000_000,  # regex analysis when the lexer is built (~50k/ms)
    step_lexer_fuel=200_000,  # lexer work per mask (~14k/ms)
    step_max_items=50_000,  # Earley items per mask (~20k/ms)
    max_lexer_states=250_000,  # lexer states (1-2 kB each)
    max_grammar_size=500_000,  # symbols in the grammar's productions
    verbose_errors=False,
)


def parser_limits():
    """A fresh ``llguidance.LLParserLimits`` of :data:`PARSER_LIMITS`."""
    import llguidance

    return llguidance.LLParserLimits(**PARSER_LIMITS)


def checkpoint_eos_token_ids(model_dir: str | Path) -> list[int]:
    """The checkpoint's ``eos_token_id`` values (``generation_config.json`` and ``config.json``), sorted.

    llguidance treats the first as its end of sequence; which tokens really end a
    grammar request is decided per request by the coordinator's stop ids
    (``SamplingParams.grammar_stop_ids``), allowed only where the grammar accepts.
    """
    model_dir = Path(model_dir)
    eos: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        eos.update(value if isinstance(value, list) else [] if value is None else [value])
    return sorted(eos)


def llg_tokenizer(model_dir: str | Path, vocab_size: int):
    """The checkpoint's ``llguidance.LLTokenizer`` (from ``tokenizer.json``; about a second to build).

    Args:
        model_dir: the checkpoint directory.
        vocab_size: rows of the model's logits (masks are this wide).
    """
    import llguidance

    model_dir = Path(model_dir)
    eos = checkpoint_eos_token_ids(model_dir)
    return llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=vocab_size,
                                  eos_token=eos or None)


def build_matcher(tokenizer, grammar: str):
    """An ``llguidance.LLMatcher`` of ``grammar`` under :data:`PARSER_LIMITS`, its first mask computed (the
    GIL is released while it builds).

    The first mask is part of the build: llguidance builds its lexer lazily, and the first mask of a
    pathological regex (``(d{1000}){1000}``: 0.8-1.8 s) is where that work happens. Done here, it
    happens in the coordinator's compile child, under its time limit, and on rank 0 off the step
    thread (``PrepareGrammar``); the sequences' matchers are copies that share the built lexer.

    Raises:
        ValueError: llguidance rejects the grammar or a limit is hit (the message is llguidance's), or no
            token of the vocabulary can start an output the grammar accepts (a regex that matches
            nothing, text only a special token spells, a schema that only recurses).
    """
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if not matcher.is_error():
        mask = bytearray(matcher.compute_bitmask())  # bit i (little-endian): token i allowed
        for eos in tokenizer.eos_tokens:  # llguidance's eos: an end, allowed only where it accepts
            mask[eos // 8] &= ~(1 << eos % 8) & 0xFF
        if not matcher.is_error() and not matcher.is_accepting() and mask.count(0) == len(mask):
            raise ValueError("no token of the model's vocabulary can start text that the output format accepts")
    if matcher.is_error():
        error = matcher.get_error().replace("<non-verbose/>", "").strip()[:500]
        if error == "NoExtensionBias":  # llguidance's name for a lexer that matches nothing
            error = f"it accepts no text at all (llguidance: {error})"
        raise ValueError(error)
    return matcher
