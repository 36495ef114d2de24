"""GLM-4.5 MoE (worker/models/glm4_moe.py) against ``transformers`` at tensor-parallel degrees 1, 2 and 4.

See tests/worker/moe_family_check.py for what is checked. The tiny model has 2 layers
(``first_k_dense_replace=1``: layer 0 dense, layer 1 MoE), 8 routed experts in 4 groups of
which 2 are kept, top-3 with a seeded ``e_score_correction_bias``, ``routed_scaling_factor``
2.5, one shared expert, partial RoPE (``head_dim`` 32, the default factor 0.5: 16 rotated
dims), per-head QK-norm and q/k/v biases.
"""

from __future__ import annotations

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.moe_family_check import FamilyCase, build_case, check_family

SPEC = TinyModelSpec("glm4_moe", "glm4_moe", {
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 190,
    "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "use_qk_norm": True, "attention_bias": True, "tie_word_embeddings": False}, seed=41)


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> FamilyCase:
    return build_case(SPEC, tmp_path_factory.mktemp("glm4_moe"), moe_layers={1}, top_k=3)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_glm4_moe_matches_transformers(case: FamilyCase, tp: int) -> None:
    check_family(case, tp)
