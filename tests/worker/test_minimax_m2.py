"""MiniMax-M2 (worker/models/minimax_m2.py) against ``transformers`` at tensor-parallel degrees 1, 2 and 4.

See tests/worker/moe_family_check.py for what is checked. The tiny model has 2 MoE
layers of 8 experts, top-2 by sigmoid score plus a seeded ``e_score_correction_bias``;
full-width QK-norm (at tp 2 and 4 the sums of squares cross ranks; at tp 4 the 2 key
heads are replicated, each on 2 ranks); partial RoPE, ``rotary_dim`` 16 of ``head_dim`` 32.
Also: decode through graph-sized batches at tp 2, where the padding rows join the norm's all-reduce.
"""

from __future__ import annotations

import pytest

from tests.worker.moe_family_check import FamilyCase, at_once_job, build_case, check_family, check_job
from tests.worker.sigmoid_moe_specs import MINIMAX_M2
from tests.worker.tp_harness import run_jobs

SPEC = MINIMAX_M2  # tests/worker/sigmoid_moe_specs.py


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> FamilyCase:
    return build_case(SPEC, tmp_path_factory.mktemp("minimax_m2"), moe_layers={0, 1}, top_k=2)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_minimax_m2_matches_transformers(case: FamilyCase, tp: int) -> None:
    check_family(case, tp)


def test_decode_graph_padding_rows_at_tp_2(case: FamilyCase) -> None:
    """3 sequences decode 4 steps through graphs of 4 rows on 2 ranks: the same tokens and logits."""
    job = at_once_job(case, num_prompts=3, num_steps=5, graph_size=4)
    check_job(case, job, run_jobs([job], tp_size=2)[job.name])
