"""Per-expert routed-token counts: from rank 0's StepResult, over the wire, into the coordinator's counter."""

from __future__ import annotations

from coordinator.metrics import Metrics
from tpserve.step import StepResult
from tpserve.step_pb import result_from_pb, result_to_pb


def test_expert_token_counts_cross_the_wire() -> None:
    result = StepResult(7, (5,), expert_token_counts=(0, 3, 2, 1, 0, 40000))
    assert result_from_pb(result_to_pb(result)) == result
    assert result_from_pb(result_to_pb(StepResult(8, (1,)))).expert_token_counts == ()


def test_counter_adds_each_steps_counts_by_layer_and_expert() -> None:
    metrics = Metrics()
    metrics.add_expert_tokens((0, 3, 2, 1, 0, 5))
    metrics.add_expert_tokens((0, 3, 4))

    def value(layer: str, expert: str) -> float | None:
        return metrics.registry.get_sample_value("tpserve:moe_expert_tokens_total", {"layer": layer, "expert": expert})

    assert value("0", "3") == 6.0
    assert value("1", "0") == 5.0
    assert value("0", "0") is None  # never routed to: not exported
