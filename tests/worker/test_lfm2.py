"""LFM2 (a hybrid: short-convolution state layers beside attention layers) against ``transformers``.

Two tiny seeded ``lfm2`` checkpoints through the scenario of tests/worker/family_check.py at
tensor-parallel degrees 1, 2 and 4 (greedy tokens, logits within 1e-4 alone and 16 at once, chunked
prefill carrying the convolution state across chunks, prefix hits resuming from state
checkpoints, preemption by recompute, prompt logprobs):

* ``lfm2``: four layers, conv / attention alternating (``layer_types``), biased convolutions
  (``conv_bias``: in_proj, the taps and out_proj), kernel 3, GQA 4:2 with QK-norm;
* ``lfm2_idxs``: the older config form (``full_attn_idxs``), three layers of which one attends,
  kernel 4, no bias, untied LM head.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import TinyModelSpec
from tests.worker.family_check import case, check, register

pytestmark = pytest.mark.xdist_group("families")

LFM2 = register(TinyModelSpec("lfm2", "lfm2", {
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 190,
    "intermediate_size": 192, "block_multiple_of": 32, "conv_L_cache": 3, "conv_bias": True, "norm_eps": 1e-5,
    "layer_types": ["conv", "full_attention", "conv", "full_attention"],
}, seed=71), None)
LFM2_IDXS = register(TinyModelSpec("lfm2_idxs", "lfm2", {
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 190,
    "intermediate_size": 96, "block_multiple_of": 16, "conv_L_cache": 4, "full_attn_idxs": [2],
    "tie_word_embeddings": False,
}, seed=72), None)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", [LFM2, LFM2_IDXS])
def test_lfm2_matches_transformers(name: str, tp: int) -> None:
    check(name, tp)


def test_lfm2_layers_and_state_shapes() -> None:
    """Guards the test: the conv layers are state layers with the (hidden / tp, L - 1) window, the
    attention layers have KV caches, and the MLP width follows Lfm2MLP's rule."""
    from tpserve.model_config import ModelConfig
    from worker.models.lfm2 import lfm2_mlp_width

    config = ModelConfig.from_pretrained(case(LFM2).jobs[0].model_dir)
    assert config.layer_types == ("conv", "full_attention", "conv", "full_attention")
    assert config.state_layer_indices == (0, 2) and config.num_attention_layers == 2
    assert lfm2_mlp_width(config) == 128  # int(2 * 192 / 3) = 128, a multiple of 32
    old = ModelConfig.from_pretrained(case(LFM2_IDXS).jobs[0].model_dir)
    assert old.layer_types == ("conv", "conv", "full_attention") and old.state_layer_indices == (0, 1)
    assert lfm2_mlp_width(old) == 64
    # A model with prefix hits restored state: the scenario really restores and checkpoints.
    plans = case(LFM2).jobs[1].plans
    assert sum(len(p.restored_states) for p in plans) >= 3
    assert sum(len(p.state_checkpoints) for p in plans) >= 40
    assert torch.float32  # float32 checkpoints: the 1e-4 tolerance of family_check
