"""Accents, CJK and emoji stream out whole, never as a broken UTF-8 character.

A byte-fallback tokenizer spells a character it has no token for as 2 to 4 byte
tokens, so a stream that emitted text per token would cut characters in half. To
make the model produce such text on demand, a tiny Llama is trained (seconds, seeded)
to recite one passage; Hugging Face ``transformers`` confirms it does, then tpserve
serves it at tensor-parallel degree 2 and every stream delta is checked.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.e2e.cluster import serve
from tests.paths import STORIES_DIR
from tpserve.embedded_model import default_model_dir

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PASSAGE = "Grüße aus Köln, señor! 日本語のテキスト。中文也可以。Emoji 🙂👍🏽 and a family 👨‍👩‍👧 — ¡Olé! Ça va? 한국어 끝."
PROMPT_TOKENS = 4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
#: Training stops once memorised with this logit margin (about 100 steps), or after MAX_TRAINING_STEPS.
MARGIN = 2.0
MAX_TRAINING_STEPS = 400


def tokenizer_dir() -> Path:
    for candidate in (default_model_dir(), STORIES_DIR):
        if (candidate / "tokenizer.json").is_file():
            return candidate
    pytest.skip("no byte-fallback tokenizer: neither the embedded model nor ../shared is present")


@pytest.fixture(scope="module")
def reciting_model(tmp_path_factory) -> tuple[Path, list[int], list[int]]:
    from tokenizers import Tokenizer

    source = tokenizer_dir()
    out = tmp_path_factory.mktemp("reciter")
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, out / name)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = tokenizer.encode(PASSAGE).ids  # starts with <s>
    eos = tokenizer.token_to_id("</s>")
    sequence = ids + [eos]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=ids[0],
        eos_token_id=eos, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = torch.tensor([sequence])
    targets = batch[0, PROMPT_TOKENS:]  # what positions PROMPT_TOKENS - 1 ... predict
    for _ in range(MAX_TRAINING_STEPS):
        step = model(input_ids=batch, labels=batch)
        # Memorised with room to spare: every completion token leads its runner-up by MARGIN logits (teacher
        # forced, which is what greedy decoding of a memorised passage sees), so float32 differences between
        # transformers and tpserve at tp 2 cannot flip a token. Checked below with transformers' generate.
        logits = step.logits[0, PROMPT_TOKENS - 1:-1].detach()
        chosen = logits.gather(1, targets[:, None])[:, 0]
        runner_up = logits.scatter(1, targets[:, None], float("-inf")).max(dim=1).values
        if bool((chosen - runner_up > MARGIN).all()):
            break
        optimizer.zero_grad()
        step.loss.backward()
        optimizer.step()
    loss = step.loss
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    prompt, completion = ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS:]
    # The reference: transformers itself must recite the passage greedily.
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=len(completion) + 1, do_sample=False)
    assert generated[0, PROMPT_TOKENS:].tolist() == completion + [eos], f"not memorised (loss {loss.item():.4f})"
    assert any(tokenizer.id_to_token(t).startswith("<0x") for t in completion), "the passage needs byte tokens"
    return out, prompt, completion


def test_stream_never_breaks_a_character(reciting_model) -> None:
    from tokenizers import Tokenizer

    model_dir, prompt, completion = reciting_model
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    whole = tokenizer.decode(prompt + completion, skip_special_tokens=True)
    expected = whole[len(tokenizer.decode(prompt, skip_special_tokens=True)):]
    assert "\ufffd" not in expected
    with serve(model_dir, 2) as cluster:
        chunks = list(cluster.client.generate_stream(prompt, max_tokens=200, temperature=0))
        unary = cluster.client.generate(prompt, max_tokens=200, temperature=0)
    deltas = [c.text for c in chunks]
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == expected == unary.text
    assert [t for c in chunks for t in c.token_ids] == completion == unary.token_ids
    assert unary.finish_reason == "stop"
    # Some chunks carry byte tokens but no text yet: the character was held back, not cut.
    assert any(c.token_ids and not c.text for c in chunks)
