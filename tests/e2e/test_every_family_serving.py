"""``tpserve serve --model <tiny checkpoint>`` prints ``transformers``' greedy text, for every family.

Issue 19's acceptance: each registered family that a tiny seeded random checkpoint stands for
(dense, sliding-window, RoPE-scaled, mixture-of-experts, attention sinks, hybrid state layers) served at tensor-parallel degree 1 by
the real server, then ``tpserve generate --json`` on a text prompt, 40 greedy tokens past any
window. The checkpoints are the ones the worker-level family tests check at tp 1, 2 and 4
(tests/worker/test_*), at stories260k's 512-token vocabulary with its tokenizer. The prompt's
ids come from the ``tokenizers`` file itself: ``AutoTokenizer`` would pick a tokenizer class
by the config's model type (``Qwen2Tokenizer`` for qwen2), which this Llama tokenizer is not.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cluster import serve
from tests.family_specs import FAMILIES, family_specs
from tests.paths import STORIES_DIR, requires_stories
from tests.tiny_models import TinyModelSpec, build_hf_model, load_hf_model

pytestmark = [pytest.mark.e2e, requires_stories]

MAX_TOKENS = 40
PROMPT = "Once upon a time"


def _servable(spec: TinyModelSpec, directory: Path) -> Path:
    """``spec`` at 512 tokens of vocabulary and 256 positions, with stories260k's tokenizer; the
    LM head's byte-fallback rows zeroed so that greedy text is whole tokens (see
    tests/tiny_models.py:save_servable_model)."""
    import torch
    from tokenizers import Tokenizer

    spec = dataclasses.replace(spec, config={**spec.config, "vocab_size": 512, "max_position_embeddings": 256})
    model = build_hf_model(spec)
    vocab = Tokenizer.from_file(str(STORIES_DIR / "tokenizer.json")).get_vocab()
    with torch.no_grad():
        model.get_output_embeddings().weight[[i for t, i in vocab.items() if t.startswith("<0x")]] = 0.0
    model.save_pretrained(directory, safe_serialization=True)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES_DIR / file, directory / file)
    return directory


@pytest.mark.parametrize("name", FAMILIES)
def test_serve_prints_transformers_greedy_text(name: str, tmp_path: Path) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast

    model_dir = _servable(family_specs()[name], tmp_path / name)
    model = load_hf_model(model_dir)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    want = out[0, len(prompt_ids):].tolist()
    prefix = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    want_text = tokenizer.decode(prompt_ids + want, skip_special_tokens=True)[len(prefix):]
    with serve(model_dir, 1) as cluster:
        printed = subprocess.run(
            [sys.executable, "-m", "launch.cli", "generate", "--target", cluster.target, "--temperature", "0",
             "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json", PROMPT],
            capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(printed.stdout)
    assert result["usage"]["prompt_tokens"] == len(prompt_ids)
    assert result["token_ids"] == want
    assert result["text"] == want_text
