"""Mistral, Qwen2 and Phi-3 with sliding windows at tensor-parallel degrees 1, 2 and 4 against ``transformers``.

Tiny checkpoints with an 8-token window over 4-token blocks, prompts and generations
far longer than it, through the scenario of tests/worker/family_check.py (chunked
prefill split on the window's edge, prefix-cache hits, preemption). Mistral slides on
every layer, as Phi-3 (its 4k models' 2047-token window, fused checkpoint tensors) does;
Qwen2 (``use_sliding_window``, ``max_window_layers=1``) only on its second, so a full and
a sliding layer share one block table. Qwen3 takes Qwen2's keys: its layers' windows
are checked on the model built on the meta device. Head size 32 puts decodes and
short chunks on the compiled CPU kernel, longer chunks on SDPA.
"""

from __future__ import annotations

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.family_check import case, check, register

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

WINDOW = 8
MISTRAL = register(TinyModelSpec("mistral_window", "mistral", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 150,
    "sliding_window": WINDOW}, seed=11), WINDOW)
QWEN2 = register(TinyModelSpec("qwen2_window", "qwen2", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 170,
    "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}, seed=12), WINDOW)
PHI3 = register(TinyModelSpec("phi3_window", "phi3", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 160, "sliding_window": WINDOW,
    "pad_token_id": 0}, seed=13), WINDOW)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", [MISTRAL, QWEN2, PHI3])
def test_sliding_window_model_matches_transformers(name: str, tp: int) -> None:
    check(name, tp)


def test_the_checkpoints_really_slide() -> None:
    """Guards the test itself: the saved configs give the windows the docstring promises."""
    from tpserve.model_config import ModelConfig

    mistral = ModelConfig.from_pretrained(case(MISTRAL).jobs[0].model_dir)
    qwen = ModelConfig.from_pretrained(case(QWEN2).jobs[0].model_dir)
    assert [mistral.layer_sliding_window(i) for i in range(2)] == [WINDOW, WINDOW]
    assert [qwen.layer_sliding_window(i) for i in range(2)] == [None, WINDOW]


def test_qwen3_layers_take_their_windows() -> None:
    import torch

    from tpserve.model_config import ModelConfig
    from worker.models.qwen3 import Qwen3ForCausalLM
    from worker.parallel_state import ParallelContext

    config = ModelConfig.from_dict({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 96, "use_sliding_window": True, "sliding_window": WINDOW,
        "max_window_layers": 1})
    model = Qwen3ForCausalLM(config, ParallelContext.single("meta"), torch.float32, tie_word_embeddings=True)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [None, WINDOW, WINDOW]
