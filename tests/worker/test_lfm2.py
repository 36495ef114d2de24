"""LFM2 (a hybrid: short-convolution state layers beside attention layers) against ``transformers``.

Two tiny seeded ``lfm2`` checkpoints through the scenario of tests/worker/family_check.py at
tensor-parallel degrees 1, 2 and 4 (greedy tokens, logits within 1e-4 alone and 16 at once, chunked
prefill carrying the convolution state across chunks, prefix hits resuming from state
checkpoints, preemption by recompute, prompt logprobs); the checkpoints are tests/worker/hybrid_specs.py's.
"""

from __future__ import annotations

import pytest

from tests.worker import hybrid_specs
from tests.worker.family_check import case, check, register

pytestmark = pytest.mark.xdist_group("families")

LFM2 = register(hybrid_specs.LFM2, None)
LFM2_IDXS = register(hybrid_specs.LFM2_IDXS, None)


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
