"""GLM-4.5, MiniMax-M2 and Ernie 4.5 MoE through the serving scenario of tests/worker/family_check.py.

The checkpoints of tests/worker/test_glm4_moe.py, test_minimax_m2.py and test_ernie4_5_moe.py
(those check the experts' counts and batch invariance, alone and 16 at once); here every
sampled token, its logits and the prompt logprobs against ``transformers`` at degrees 1, 2
and 4 through chunked prefill (chunks of 8 tokens), prefix-cache hits, preemption with
recompute, and prompts of up to 40 tokens.
"""

from __future__ import annotations

import pytest

from tests.worker import test_ernie4_5_moe, test_glm4_moe, test_minimax_m2
from tests.worker.family_check import check, register

# Every registered family runs in one process group per degree (family_check.py): one test process for all.
pytestmark = pytest.mark.xdist_group("families")

NAMES = [register(module.SPEC, None) for module in (test_glm4_moe, test_minimax_m2, test_ernie4_5_moe)]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_sigmoid_moe_family_serving_scenario(name: str, tp: int) -> None:
    check(name, tp)
