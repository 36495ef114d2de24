"""``tpserve serve`` on the newer families' tiny checkpoints prints ``transformers``' greedy text.

Each family of ``FAMILIES`` (tests/tiny_models.py, rebuilt with stories260k's tokenizer and
512-token vocabulary, seeded random weights) is served once at tensor-parallel degree 2;
``tpserve generate --json`` and the client, for token-id prompts too, must print and return
``generate(do_sample=False)``'s tokens and their ``transformers`` decoding.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cluster import serve
from tests.paths import STORIES_DIR, requires_stories
from tests.tiny_models import load_hf_model, save_servable_model

pytestmark = [pytest.mark.e2e, requires_stories]

FAMILIES = ("qwen3_qk_norm",)
MAX_TOKENS = 24
PROMPT = "Once upon a time"
TOKEN_PROMPTS = [[1, 403, 407, 261, 9], [1, 250, 33]]


@pytest.mark.parametrize("name", FAMILIES)
def test_serve_prints_transformers_greedy_text(name: str, tmp_path: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    model_dir = save_servable_model(name, tmp_path / name, STORIES_DIR)
    model, tokenizer = load_hf_model(model_dir), AutoTokenizer.from_pretrained(model_dir)

    def reference(prompt_ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt_ids):].tolist()

    def text(prompt_ids: list[int], completion: list[int]) -> str:
        """The completion's text as it continues the prompt (a leading space kept)."""
        whole = tokenizer.decode(prompt_ids + completion, skip_special_tokens=True)
        return whole[len(tokenizer.decode(prompt_ids, skip_special_tokens=True)):]

    text_ids = tokenizer(PROMPT)["input_ids"]
    want = reference(text_ids)
    with serve(model_dir, 2) as cluster:
        out = subprocess.run(
            [sys.executable, "-m", "launch.cli", "generate", "--target", cluster.target, "--temperature", "0",
             "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json", PROMPT],
            capture_output=True, text=True, timeout=60, check=True)
        results = [cluster.client.generate(ids, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
                   for ids in TOKEN_PROMPTS]
    printed = json.loads(out.stdout)
    assert printed["usage"]["prompt_tokens"] == len(text_ids)
    assert printed["token_ids"] == want
    assert printed["text"] == text(text_ids, want)
    for ids, result in zip(TOKEN_PROMPTS, results, strict=True):
        assert result.token_ids == reference(ids)
        assert result.text == text(ids, result.token_ids)
