"""Qwen2-MoE (worker/models/qwen2_moe.py) against ``transformers`` at tensor-parallel degrees 1, 2 and 4.

See tests/worker/moe_family_check.py for what is checked. The tiny model has 2
layers with ``decoder_sparse_step=2`` (layer 1 sparse, layer 0 dense), 8
experts, top-4 without renormalisation, and a shared expert behind its sigmoid gate.
"""

from __future__ import annotations

import pytest

from tests.worker.moe_specs import QWEN2_MOE_SPEC as SPEC
from tests.worker.moe_family_check import FamilyCase, build_case, check_family


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> FamilyCase:
    return build_case(SPEC, tmp_path_factory.mktemp("qwen2_moe"), moe_layers={1}, top_k=4)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen2_moe_matches_transformers(case: FamilyCase, tp: int) -> None:
    check_family(case, tp)
