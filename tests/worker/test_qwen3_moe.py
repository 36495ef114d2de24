"""Qwen3-MoE (worker/models/qwen3_moe.py) against ``transformers`` at tensor-parallel degrees 1, 2 and 4.

See tests/worker/moe_family_check.py for what is checked. The tiny model has 2
layers, layer 1 dense (``mlp_only_layers``), 8 experts, top-2 renormalised
(``norm_topk_prob``; the layer tests cover it off), QK-norm with ``head_dim`` 32.
"""

from __future__ import annotations

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.moe_family_check import FamilyCase, build_case, check_family

SPEC = TinyModelSpec("qwen3_moe", "qwen3_moe", {"num_attention_heads": 4,
                                                "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 180,
                                                "moe_intermediate_size": 32, "num_experts": 8,
                                                "num_experts_per_tok": 2, "norm_topk_prob": True,
                                                "mlp_only_layers": [1], "tie_word_embeddings": False}, seed=22)


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> FamilyCase:
    return build_case(SPEC, tmp_path_factory.mktemp("qwen3_moe"), moe_layers={0}, top_k=2)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen3_moe_matches_transformers(case: FamilyCase, tp: int) -> None:
    check_family(case, tp)
