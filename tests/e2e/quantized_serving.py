"""The quantized checkpoints' end-to-end scenario, shared by tests/e2e/test_int4_serving.py and
test_w8a16_serving.py: four prompts of stories260k's token ids at once through ``tpserve serve``, against
``transformers``' greedy tokens on the checkpoint's dequantized float twin (the format's reference)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tests.e2e.cluster import serve
from tests.tiny_models import load_hf_model

PROMPTS = [[1, 306, 443, 278], [1, 90, 250, 263, 93], [1, 450, 112], [1, 365, 235, 322, 67, 170]]
NEW_TOKENS = 12


def reference_tokens(dequantized: Path) -> list[list[int]]:
    """``transformers``' greedy :data:`NEW_TOKENS` tokens after each of :data:`PROMPTS` (no EOS stop)."""
    model = load_hf_model(dequantized)
    model.generation_config.eos_token_id = None
    want = []
    for prompt in PROMPTS:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        want.append(out[0, len(prompt):].tolist())
    return want


def served_tokens(checkpoint: Path, tp: int, log_path: Path | None = None) -> tuple[list[list[int]], str]:
    """Every prompt of :data:`PROMPTS` at once through ``tpserve serve`` at degree ``tp``, greedy, ``ignore_eos``;
    and what the server's ``GetModelInfo`` reports as its ``quantization``."""
    with serve(checkpoint, tp, log_path=log_path) as cluster:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: cluster.client.generate(p, max_tokens=NEW_TOKENS, temperature=0,
                                                                     ignore_eos=True), PROMPTS))
        quantization = cluster.client.model_info().quantization
    return [list(r.token_ids) for r in results], quantization
