"""The special tokens a ``tokenizers.Tokenizer``'s post-processor adds, and a copy that adds the ones we say.

:class:`coordinator.tokenizer.Tokenizer` decides once whether a prompt starts with the bos
token (``tokenizer_config.json``'s ``add_bos_token``, else the post-processor's own habit) and
fixes up what the post-processor did. A client that loads ``tokenizer.json`` alone (the
gateway, from GetTokenizer: coordinator/vllm_engine_service.py) sees only the post-processor,
so the file it gets must carry the same decision: :func:`with_special_tokens` rewrites the
post-processor as ``transformers``' ``LlamaTokenizerFast.update_post_processor`` does, a
``TemplateProcessing`` of ``[bos] $A [eos]``.

No torch.
"""

from __future__ import annotations

import tokenizers
from tokenizers import processors

#: A text any vocabulary encodes to at least one token, for probing the post-processor.
_PROBE_TEXT = "a"


def post_processor_tokens(backend: tokenizers.Tokenizer) -> tuple[int | None, int | None]:
    """``(first, last)``: the token the post-processor puts before a single sequence and the one it
    puts after it, each None when it adds none there (probed: with and without special tokens)."""
    special = backend.encode(_PROBE_TEXT, add_special_tokens=True).ids
    plain = backend.encode(_PROBE_TEXT, add_special_tokens=False).ids
    start = next((i for i in range(len(special) - len(plain) + 1) if special[i:i + len(plain)] == plain), None)
    if start is None:
        return None, None  # the post-processor rewrote the tokens themselves: nothing to tell apart
    after = special[start + len(plain):]
    return (special[start - 1] if start else None), (after[-1] if after else None)


def with_special_tokens(backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                        eos_token_id: int | None) -> tokenizers.Tokenizer:
    """A copy of ``backend`` whose post-processor adds exactly ``bos_token_id`` first and
    ``eos_token_id`` last (None: that one is not added), each sequence of a pair too.

    A byte-level post-processor (offset trimming, no tokens) is kept, before the template; any
    other is replaced.

    Raises:
        ValueError: an id is not in the vocabulary.
    """
    copy = tokenizers.Tokenizer.from_str(backend.to_str())
    bos, eos = (None if token_id is None else _token(copy, token_id) for token_id in (bos_token_id, eos_token_id))
    special = [(token, token_id) for token, token_id in ((bos, bos_token_id), (eos, eos_token_id)) if token]

    def sequence(name: str, type_id: int) -> str:
        parts = [f"{bos}:{type_id}"] if bos else []
        parts.append(f"${name}:{type_id}")
        return " ".join(parts + ([f"{eos}:{type_id}"] if eos else []))

    template = processors.TemplateProcessing(single=sequence("A", 0), pair=f"{sequence('A', 0)} {sequence('B', 1)}",
                                             special_tokens=special)
    existing = copy.post_processor
    copy.post_processor = (processors.Sequence([existing, template]) if isinstance(existing, processors.ByteLevel)
                           else template)
    return copy


def _token(backend: tokenizers.Tokenizer, token_id: int) -> str:
    token = backend.id_to_token(token_id)
    if token is None:
        raise ValueError(f"token id {token_id} is not in the vocabulary")
    return token
