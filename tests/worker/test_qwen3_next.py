"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet + gated attention) through the runner, against ``transformers``.

The three tiny seeded checkpoints of tests/worker/hybrid_specs.py through the scenario of
tests/worker/family_check.py at tensor-parallel degrees 1 and 2 (greedy tokens, logits within
1e-4 + 1e-4 * |logit| alone and 16 at once, chunked prefill carrying the conv and recurrent states across
chunks, prefix hits resuming from state checkpoints, preemption by recompute, prompt logprobs within 1e-4: the
default tolerance, which the checkpoints' correlated DeltaNet queries and keys make meaningful; tests/tiny_models.py's
``_correlate_queries_with_keys`` says why).
Prompts longer than one 64-row DeltaNet chunk, and the DeltaNet layers without the runner (a decode group
beside prefills in one step, checkpoints restored by hand): tests/worker/test_hybrid_models.py.
"""

from __future__ import annotations

import pytest

from tests.worker import hybrid_specs
from tests.worker.family_check import case, check, register

pytestmark = pytest.mark.xdist_group("families")

#: 2 key heads (one per rank at tp 2): these checkpoints do not split over 4 ranks.
TP_SIZES = (1, 2)
QWEN3_NEXT = register(hybrid_specs.QWEN3_NEXT_SPEC, None, tp_sizes=TP_SIZES)
QWEN3_5 = register(hybrid_specs.QWEN3_5_SPEC, None, tp_sizes=TP_SIZES)
QWEN3_5_MOE = register(hybrid_specs.QWEN3_5_MOE_SPEC, None, tp_sizes=TP_SIZES)


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("name", [QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE])
def test_gated_delta_net_family_matches_transformers(name: str, tp: int) -> None:
    check(name, tp)


def test_state_layers_and_shapes() -> None:
    """Guards the test: layers 0-2 are state layers with this rank's (conv, recurrent) shapes, layer 3 attends,
    and the scenario restores and saves states."""
    from tpserve.model_config import ModelConfig

    for name in (QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE):
        config = ModelConfig.from_pretrained(case(name).jobs[0].model_dir)
        assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
        assert config.state_layer_indices == (0, 1, 2) and config.num_attention_layers == 1
        assert config.rotary_dim == 4
    plans = case(QWEN3_NEXT).jobs[1].plans
    assert sum(len(p.restored_states) for p in plans) >= 3
    assert sum(len(p.state_checkpoints) for p in plans) >= 40
