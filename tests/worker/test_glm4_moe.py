"""GLM-4.5 MoE (worker/models/glm4_moe.py) against ``transformers`` at tensor-parallel degrees 1, 2 and 4.

See tests/worker/moe_family_check.py for what is checked. The tiny model has 2 layers
(``first_k_dense_replace=1``: layer 0 dense, layer 1 MoE), 8 routed experts in 4 groups of
which 2 are kept, top-3 with a seeded ``e_score_correction_bias``, ``routed_scaling_factor``
2.5, one shared expert, partial RoPE (``head_dim`` 32, the default factor 0.5: 16 rotated
dims), per-head QK-norm and q/k/v biases. Also: decode through graph-sized batches (padding rows
routed, then subtracted from the expert counts) and the CUDA path's grouped Triton experts (in
Triton's interpreter) with the sigmoid router's scaled float32 weights.
"""

from __future__ import annotations

import pytest

from tests.tiny_models import TinyModelSpec
from tests.worker.moe_family_check import FamilyCase, at_once_job, build_case, check_family, check_job
from tests.worker.tp_harness import run_jobs
from worker.kernels.triton_moe import grouped_experts_triton
from worker.layers import moe

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


def test_decode_graph_padding_rows_are_not_counted(case: FamilyCase) -> None:
    """3 sequences decode 4 steps through graphs of 4 rows: same tokens, and the padding row's experts subtracted."""
    job = at_once_job(case, num_prompts=3, num_steps=5, graph_size=4)
    check_job(case, job, run_jobs([job], tp_size=1)[job.name])


def test_the_triton_experts_serve_the_model(case: FamilyCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's grouped kernel (Triton's interpreter here) inside the model: same tokens and logits."""
    monkeypatch.setattr(moe, "grouped_experts", grouped_experts_triton)
    job = at_once_job(case, num_prompts=3, num_steps=4)
    check_job(case, job, run_jobs([job], tp_size=1)[job.name])
