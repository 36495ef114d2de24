"""``tpserve serve`` on published FP8 and MXFP4 checkpoints at tp 2: transformers' greedy text, one log line.

Three tiny checkpoints at stories260k's 512-token vocabulary with its tokenizer, written in
their format's on-disk layout by tests/worker/lowbit_checkpoints.py: a Llama in
block-scaled FP8 (32x64 blocks), the same Llama in compressed-tensors FP8, and gpt-oss
with MXFP4 experts (64 wide: each rank's 32 units whole groups, so the CPU ranks hold them as exact 8-bit codes,
worker/layers/moe_mxfp4.py). Served by the real server at tensor-parallel degree 2 (each rank
dequantizes its own shards); ``tpserve generate --json`` must print the 40 greedy tokens of
``transformers`` running the dequantized float model, and the server log must say once per
start-up how the weights were loaded. A corrupt one (a NaN FP8 scale) exits 1 at start-up,
naming the tensor, without a traceback.
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
from tests.tiny_models import TINY_MODELS, TinyModelSpec, load_hf_model, save_tiny_model
from tests.worker.lowbit_checkpoints import GPT_OSS_WIDE, save_compressed_tensors_fp8, save_fp8_block, save_mxfp4

pytestmark = [pytest.mark.e2e, requires_stories]

MAX_TOKENS = 40
PROMPT = "Once upon a time"
LLAMA = next(spec for spec in TINY_MODELS if spec.name == "gqa_tied")
WRITERS = {
    "fp8_block": (LLAMA, lambda src, dst, ref: save_fp8_block(src, dst, ref, block=(32, 64)),
                  "fp8 e4m3 block-scaled (32x64) weights dequantized at load to float32"),
    "compressed_tensors_fp8": (LLAMA, save_compressed_tensors_fp8,
                               "compressed-tensors fp8 e4m3 channel/tensor-scaled weights dequantized at load to "
                               "float32"),
    "mxfp4": (GPT_OSS_WIDE, save_mxfp4, "mxfp4 experts (e2m1 with e8m0 scales per 32): the routed experts held "
                                        "exactly as 8-bit codes with a scale per 32 (10 bits a weight, the w8 "
                                        "kernel); other tensors dequantized at load to float32"),
}


def _servable(spec: TinyModelSpec, directory: Path) -> Path:
    """``spec`` at 512 tokens of vocabulary and 256 positions, with stories260k's tokenizer."""
    spec = dataclasses.replace(spec, config={**spec.config, "vocab_size": 512, "max_position_embeddings": 256})
    save_tiny_model(spec, directory)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES_DIR / file, directory / file)
    return directory


def _generate(target: str) -> dict:
    printed = subprocess.run(
        [sys.executable, "-m", "launch.cli", "generate", "--target", target, "--temperature", "0",
         "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json", PROMPT],
        capture_output=True, text=True, timeout=60, check=True)
    return json.loads(printed.stdout)


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_serve_prints_transformers_greedy_tokens_of_the_dequantized_model_at_tp2(fmt: str, tmp_path: Path) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast

    spec, write, logged = WRITERS[fmt]
    model_dir, reference_dir = write(_servable(spec, tmp_path / "float"), tmp_path / fmt, tmp_path / "reference")
    model = load_hf_model(reference_dir)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(STORIES_DIR / "tokenizer.json"))
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    want = out[0, len(prompt_ids):].tolist()
    log_path = tmp_path / "server.log"
    with serve(model_dir, 2, "--max-model-len", "256", log_path=log_path) as cluster:
        result = _generate(cluster.target)
    assert result["usage"]["prompt_tokens"] == len(prompt_ids)
    assert result["token_ids"] == want
    assert log_path.read_text().count(logged) == 1, log_path.read_text()[-3000:]  # rank 0's line only


def test_a_corrupt_fp8_checkpoint_is_refused_at_start_up_naming_the_tensor(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir, _ = save_fp8_block(_servable(LLAMA, tmp_path / "float"), tmp_path / "fp8", tmp_path / "reference",
                                  block=(32, 64))
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight_scale_inv"][0, 1] = float("nan")
    save_file(tensors, model_dir / "model.safetensors")
    done = subprocess.run([sys.executable, "-m", "launch.cli", "serve", "--model", str(model_dir), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr[-3000:]
    (failed,) = [line for line in done.stderr.splitlines() if "start-up failed" in line]
    assert "model.layers.1.mlp.down_proj.weight_scale_inv" in failed and "non-finite" in failed, failed
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) < 10
