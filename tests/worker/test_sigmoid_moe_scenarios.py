"""GLM-4.5, MiniMax-M2 and Ernie 4.5 MoE through the serving scenario of tests/worker/family_check.py.

The checkpoints of tests/worker/sigmoid_moe_specs.py (test_glm4_moe.py, test_minimax_m2.py and
test_ernie4_5_moe.py check the experts' counts and batch invariance, alone and 16 at once); here every
sampled token, its logits and the prompt logprobs against ``transformers`` at degrees 1, 2
and 4 through chunked prefill (chunks of 8 tokens), prefix-cache hits, preemption with
recompute, and prompts of up to 40 tokens.
"""

from __future__ import annotations

import pytest

from tests.worker.family_check import check, register
from tests.worker.sigmoid_moe_specs import ERNIE4_5_MOE, GLM4_MOE, MINIMAX_M2

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

NAMES = [register(spec, None) for spec in (GLM4_MOE, MINIMAX_M2, ERNIE4_5_MOE)]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_sigmoid_moe_family_serving_scenario(name: str, tp: int) -> None:
    check(name, tp)
