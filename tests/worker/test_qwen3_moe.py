"""Qwen3-MoE (worker/models/qwen3_moe.py) against ``transformers`` at tensor-parallel degrees 1, 2 and 4.

See tests/worker/moe_family_check.py for what is checked. The tiny model has 2
layers, layer 1 dense (``mlp_only_layers``), 8 experts, top-2 renormalised
(``norm_topk_prob``; the layer tests cover it off), QK-norm with ``head_dim`` 32.
"""

from __future__ import annotations

import pytest

from tests.worker.moe_specs import QWEN3_MOE_SPEC as SPEC
from tests.worker.moe_family_check import FamilyCase, build_case, check_family


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> FamilyCase:
    return build_case(SPEC, tmp_path_factory.mktemp("qwen3_moe"), moe_layers={0}, top_k=2)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen3_moe_matches_transformers(case: FamilyCase, tp: int) -> None:
    check_family(case, tp)
