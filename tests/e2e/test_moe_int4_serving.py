"""``tpserve serve`` with 4- and 8-bit routed experts on a tiny Mixtral at tp 2, through the real server.

* ``--quantization int4 --enable-expert-parallel`` on the float checkpoint (whole experts per rank,
  quantized RTN while loading): the reference is ``transformers``' greedy text on the checkpoint with
  every expert and dense linear weight replaced by its int4 round trip (tests/worker/int4_checkpoints.py);
* a GPTQ checkpoint with one module per expert (``experts.{e}.w1.qweight`` ..., symmetric, group 32,
  written by the documented packing routine checked against AutoGPTQ's dequantization), int4 by its
  ``config.json`` alone, experts split across the ranks: the reference is ``transformers`` on the
  format's reference dequantization;
* the same as an 8-bit GPTQ checkpoint (symmetric, group 32: a byte a code, the w8 kernel per expert,
  worker/layers/moe_w8.py), experts split across the ranks.

The ranks log ``quantization: int4`` (``int8`` for the 8-bit GPTQ checkpoint), each holding less than 0.2 of the float32 checkpoint's bytes
(the embedding and LM head stay float32: 0.19 here; int8 holds 0.3), 8-bit ones less than 0.35.
tests/worker/test_moe_int4.py and test_moe_w8.py check tokens and logits at tp 1 and 2 through ``ModelRunner``.
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
from tests.worker.int4_checkpoints import save_gptq, save_rtn_dequantized
from tests.worker.int8_checkpoints import MOE_LINEAR_WEIGHT
from tests.worker.moe_specs import MIXTRAL_SPEC
from tests.worker.w8a16_checkpoints import save_gptq8

pytestmark = [pytest.mark.e2e, requires_stories]

MAX_TOKENS = 40
PROMPT = "Once upon a time"


@pytest.mark.parametrize("source", ["rtn_expert_parallel", "gptq", "gptq8"])
def test_quantized_moe_serving_at_tp2_prints_transformers_greedy_text(source: str, tmp_path: Path) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast

    float_dir = save_servable_model(MIXTRAL_SPEC, tmp_path / "mixtral", STORIES_DIR)
    if source == "gptq":
        model_dir, reference_dir = save_gptq(float_dir, tmp_path / "gptq", tmp_path / "dequantized", group=32,
                                             sym=True, desc_act=False, pattern=MOE_LINEAR_WEIGHT)
        extra: tuple[str, ...] = ()
    elif source == "gptq8":
        model_dir, reference_dir = save_gptq8(float_dir, tmp_path / "gptq8", tmp_path / "dequantized", group=32,
                                              sym=True, pattern=MOE_LINEAR_WEIGHT)
        extra = ()
    else:
        model_dir, reference_dir = float_dir, save_rtn_dequantized(float_dir, tmp_path / "dequantized",
                                                                   MOE_LINEAR_WEIGHT)
        extra = ("--quantization", "int4", "--enable-expert-parallel")
    reference = load_hf_model(reference_dir)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(float_dir / "tokenizer.json"))
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    want = out[0, len(prompt_ids):].tolist()
    log_path = tmp_path / "server.log"
    with serve(model_dir, 2, *extra, "--log-format", "json", log_path=log_path) as cluster:
        printed = subprocess.run(
            [sys.executable, "-m", "launch.cli", "generate", "--target", cluster.target, "--temperature", "0",
             "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json", PROMPT],
            capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(printed.stdout)["token_ids"] == want
    loaded = [json.loads(line) for line in log_path.read_text().splitlines() if '"shard loaded"' in line]
    assert sorted(e["rank"] for e in loaded) == [0, 1] and {e["quantization"] for e in loaded} == {"int8" if source == "gptq8" else "int4"}
    # 64-wide experts, hidden 64: no shape fits the tiles; an 8-bit checkpoint has no 4-bit layer to count
    assert [e.get("int4_tile_layout_layers") for e in loaded] == ([None, None] if source == "gptq8" else [0, 0])
    float32_bytes = sum(p.stat().st_size for p in float_dir.glob("*.safetensors"))
    bound = 0.35 if source == "gptq8" else 0.2
    assert all(e["weight_bytes"] < bound * float32_bytes for e in loaded), (loaded, float32_bytes)
