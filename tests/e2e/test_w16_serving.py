"""``tpserve serve`` on a bfloat16 checkpoint at tp 2 with float32 activations (the CPU default): each rank keeps
its shards of the decoder projections, the (untied) input embedding and the LM head in bfloat16 (worker/layers_w16.py,
worker/lm_head_w16.py;
the start-up log says so), and four prompts at once give ``transformers``' greedy tokens on the same checkpoint
run in float32. (tests/worker/test_layers_w16.py checks the logits against the float32-widened layers, bit for
bit, on every path.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.quantized_serving import reference_tokens, served_tokens
from tests.paths import STORIES_DIR, requires_stories
from tests.tiny_models import save_servable_model
from tests.worker.int8_checkpoints import save_cast
from worker.kernels import cpu_kernels_available

pytestmark = [pytest.mark.e2e, requires_stories,
              pytest.mark.skipif(not cpu_kernels_available(), reason="16-bit layers need the compiled CPU kernels")]


def test_a_bfloat16_checkpoint_served_at_tp2_keeps_its_layers_16_bit_with_transformers_tokens(tmp_path: Path) -> None:
    checkpoint = save_cast(save_servable_model("qwen2_qkv_bias", tmp_path / "float", STORIES_DIR), tmp_path / "bf16",
                           torch.bfloat16)
    log_path = tmp_path / "server.log"
    assert served_tokens(checkpoint, 2, log_path) == (reference_tokens(checkpoint), "")  # GetModelInfo: not quantized
    log = log_path.read_text()
    assert "weights kept in bfloat16 (decoder projections and the untied input embedding): their values on this rank" in log
    assert "LM head kept in bfloat16" in log
