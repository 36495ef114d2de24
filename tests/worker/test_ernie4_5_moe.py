"""Ernie 4.5 MoE (worker/models/ernie4_5_moe.py) against ``transformers`` at tensor-parallel degrees 1, 2 and 4.

See tests/worker/moe_family_check.py for what is checked. The tiny model has 3 layers
(``moe_layer_start_index=1``, ``moe_layer_interval=2``: layer 1 sparse, layers 0 and 2 dense),
8 experts, top-3 by softmax probability plus a seeded ``e_score_correction_bias``, one shared
expert, interleaved RoPE, and the LM head tied to the embedding (Ernie's default).
"""

from __future__ import annotations

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.moe_family_check import FamilyCase, build_case, check_family
from worker.models.ernie4_5_moe import is_ernie_moe_layer

SPEC = TinyModelSpec("ernie4_5_moe", "ernie4_5_moe", {
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 190,
    "moe_num_experts": 8, "moe_k": 3, "moe_intermediate_size": 32, "moe_num_shared_experts": 1,
    "moe_layer_start_index": 1, "moe_layer_interval": 2, "use_bias": False}, seed=47)


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> FamilyCase:
    return build_case(SPEC, tmp_path_factory.mktemp("ernie4_5_moe"), moe_layers={1}, top_k=3)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_ernie4_5_moe_matches_transformers(case: FamilyCase, tp: int) -> None:
    check_family(case, tp)


def test_sparse_layers_follow_start_interval_and_end() -> None:
    """As Ernie4_5_MoeDecoderLayer: every interval-th layer from start to end (-1: the last)."""
    assert [is_ernie_moe_layer(i, 6, 1, -1, 1) for i in range(6)] == [False, True, True, True, True, True]
    assert [is_ernie_moe_layer(i, 6, 0, -1, 2) for i in range(6)] == [False, True, False, True, False, True]
    assert [is_ernie_moe_layer(i, 6, 1, 3, 1) for i in range(6)] == [False, True, True, True, False, False]
