"""``tpserve serve --model <tiny Gemma 2>`` answers with ``transformers``' greedy text.

A seeded random Gemma 2 over the byte-fallback tokenizer (the embedded model's, else
stories260k's): an 8-token window on alternate layers, both soft-caps, served at
tensor-parallel degree 2; ``tpserve generate`` must print the text and token ids of
``transformers``' greedy generation, which runs far past the window.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cluster import serve
from tests.paths import STORIES_DIR
from tpserve.embedded_model import default_model_dir

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT = "Once upon a time"
MAX_TOKENS = 40
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_dir() -> Path:
    for candidate in (default_model_dir(), STORIES_DIR):
        if (candidate / "tokenizer.json").is_file():
            return candidate
    pytest.skip("no tokenizer: neither the embedded model nor ../shared is present")


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> Path:
    from tests.tiny_models import TinyModelSpec, build_hf_model

    source, out = tokenizer_dir(), tmp_path_factory.mktemp("gemma2")
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, out / name)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    spec = TinyModelSpec("gemma2_e2e", "gemma2", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": vocab,
        "max_position_embeddings": 128, "sliding_window": 8, "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "pad_token_id": 0}, seed=41)
    build_hf_model(spec).save_pretrained(out, safe_serialization=True)
    return out


def test_serve_prints_transformers_greedy_text(gemma_dir: Path) -> None:
    from coordinator.tokenizer import Tokenizer
    from tests.tiny_models import load_hf_model

    tokenizer = Tokenizer.from_pretrained(gemma_dir)  # the server's own prompt encoding
    prompt = tokenizer.encode(PROMPT)
    model = load_hf_model(gemma_dir)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=0)
    completion = out[0, len(prompt):].tolist()
    from tokenizers import Tokenizer as HfTokenizer

    raw = HfTokenizer.from_file(str(gemma_dir / "tokenizer.json"))
    whole = raw.decode(prompt + completion, skip_special_tokens=True)
    expected = whole[len(raw.decode(prompt, skip_special_tokens=True)):]
    with serve(gemma_dir, 2) as cluster:
        printed = subprocess.run(
            [sys.executable, "-m", "launch.cli", "generate", "--target", cluster.target, "--temperature", "0",
             "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json", PROMPT],
            capture_output=True, text=True, timeout=60, check=True).stdout
    result = json.loads(printed)
    assert result["token_ids"] == completion
    assert result["text"] == expected and expected.strip()
