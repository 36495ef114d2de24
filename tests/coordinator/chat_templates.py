"""Chat templates and a literal reference renderer, shared by the chat tests of the coordinator and end to end."""

from __future__ import annotations

import re
from pathlib import Path

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def literal_reference(model_dir: Path, messages: list[dict]) -> list[int]:
    """transformers' ids with every special spelling inside a content as text: rendered by transformers
    with markers for those spellings, cut at the special spellings left (the template's, encoded as
    tokens), each piece between encoded with ``split_special_tokens=True`` and the markers put back."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(model_dir)
    specials = sorted(reference.all_special_tokens, key=len, reverse=True)
    marked = [dict(m, content=m["content"]) for m in messages]
    for m in marked:
        for k, special in enumerate(specials):
            m["content"] = m["content"].replace(special, f"@@{k}@@")
    text = reference.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    ids, cursor = [], 0
    for match in re.finditer("|".join(map(re.escape, specials)), text):
        piece = re.sub(r"@@(\d+)@@", lambda g: specials[int(g.group(1))], text[cursor:match.start()])
        ids += reference.encode(piece, add_special_tokens=False, split_special_tokens=True) if piece else []
        ids.append(reference.convert_tokens_to_ids(match.group()))
        cursor = match.end()
    piece = re.sub(r"@@(\d+)@@", lambda g: specials[int(g.group(1))], text[cursor:])
    return ids + (reference.encode(piece, add_special_tokens=False, split_special_tokens=True) if piece else [])
