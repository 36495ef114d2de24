"""``tpserve serve --quantization int8`` on a tiny Mixtral at tp 2 (experts split, and whole experts per rank).

The served checkpoint is float; the reference is ``transformers``' greedy text on the same checkpoint
with every expert and dense linear weight replaced by its int8 round trip ``q * scale``
(tests/worker/int8_checkpoints.py), as tests/worker/test_moe_int8.py checks at the worker level.
Both ranks log ``quantization: int8``, each holding less than 0.3 of the float32 checkpoint's bytes.
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
from tests.paths import STORIES_DIR, requires_stories
from tests.tiny_models import build_hf_model, load_hf_model
from tests.worker.int8_checkpoints import MOE_LINEAR_WEIGHT, save_dequantized
from tests.worker.moe_specs import MIXTRAL_SPEC

pytestmark = [pytest.mark.e2e, requires_stories]

MAX_TOKENS = 40
PROMPT = "Once upon a time"


def _servable(directory: Path) -> Path:
    """The tiny Mixtral at stories260k's 512-token vocabulary with its tokenizer, the LM head's byte-fallback
    rows zeroed so that greedy text is whole tokens (as tests/e2e/test_every_family_serving.py serves it)."""
    import torch
    from tokenizers import Tokenizer

    spec = dataclasses.replace(MIXTRAL_SPEC, config={**MIXTRAL_SPEC.config, "vocab_size": 512,
                                                     "max_position_embeddings": 256})
    model = build_hf_model(spec)
    vocab = Tokenizer.from_file(str(STORIES_DIR / "tokenizer.json")).get_vocab()
    with torch.no_grad():
        model.get_output_embeddings().weight[[i for t, i in vocab.items() if t.startswith("<0x")]] = 0.0
    model.save_pretrained(directory, safe_serialization=True)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES_DIR / file, directory / file)
    return directory


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp_experts", "expert_parallel"])
def test_int8_moe_serving_at_tp2_prints_transformers_greedy_text(expert_parallel: bool, tmp_path: Path) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast

    model_dir = _servable(tmp_path / "mixtral")
    reference = load_hf_model(save_dequantized(model_dir, tmp_path / "dequantized", MOE_LINEAR_WEIGHT))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    want = out[0, len(prompt_ids):].tolist()
    log_path = tmp_path / "server.log"
    extra = ("--enable-expert-parallel",) if expert_parallel else ()
    with serve(model_dir, 2, "--quantization", "int8", *extra, "--log-format", "json", log_path=log_path) as cluster:
        printed = subprocess.run(
            [sys.executable, "-m", "launch.cli", "generate", "--target", cluster.target, "--temperature", "0",
             "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json", PROMPT],
            capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(printed.stdout)["token_ids"] == want
    loaded = [json.loads(line) for line in log_path.read_text().splitlines() if '"shard loaded"' in line]
    assert sorted(e["rank"] for e in loaded) == [0, 1] and {e["quantization"] for e in loaded} == {"int8"}
    float32_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    assert all(e["weight_bytes"] < 0.3 * float32_bytes for e in loaded), (loaded, float32_bytes)
