"""Gemma 2 at tensor-parallel degrees 1, 2 and 4 against ``transformers``.

A tiny seeded checkpoint with every Gemma 2 trait made to matter: a 12-token window on
alternate layers (local, global), attention-logit and final-logit soft-caps small enough
to bend the scores, ``query_pre_attn_scalar`` unlike the head size, ``(1 + w)`` norms with
random ``w``, tanh-GELU, the embedding scaled by ``sqrt(hidden)``. Degree 4 replicates its
2 KV heads. It runs the scenario of tests/worker/family_check.py (prompts and generations
past the window, chunked prefill on its edge, prefix-cache hits, preemption, prompt
logprobs). Head size 32: decodes and short chunks on the compiled CPU kernel, long
chunks on the soft-capped torch path.
"""

from __future__ import annotations

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.family_check import case, check, register

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

WINDOW = 12
GEMMA2 = register(TinyModelSpec("gemma2", "gemma2", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 180,
    "sliding_window": WINDOW, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
    "final_logit_softcapping": 3.0, "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 0,
}, seed=21), WINDOW)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gemma2_matches_transformers(tp: int) -> None:
    check(GEMMA2, tp)


def test_gemma2_layers_alternate_and_cap() -> None:
    """Guards the test: local and global layers alternate, and the caps are in the checkpoint's config."""
    from tpserve.model_config import ModelConfig

    config = ModelConfig.from_pretrained(case(GEMMA2).jobs[0].model_dir)
    assert [config.layer_sliding_window(i) for i in range(2)] == [WINDOW, None]
    assert config.hf_value("attn_logit_softcapping", 0.0) == 2.0
