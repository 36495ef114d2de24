"""Ernie 4.5 MoE (worker/models/ernie4_5_moe.py) against ``transformers`` at tensor-parallel degrees 1, 2 and 4.

See tests/worker/moe_family_check.py for what is checked. The tiny model has 3 layers
(``moe_layer_start_index=1``, ``moe_layer_interval=2``: layer 1 sparse, layers 0 and 2 dense),
8 experts, top-3 by softmax probability plus a seeded ``e_score_correction_bias``, one shared
expert, interleaved RoPE, and the LM head tied to the embedding (Ernie's default).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.worker.moe_family_check import FamilyCase, build_case, check_family
from tests.worker.sigmoid_moe_specs import ERNIE4_5_MOE
from tpserve.model_config import ModelConfig
from worker.loader import load_model
from worker.models.ernie4_5_moe import is_ernie_moe_layer
from worker.parallel_state import ParallelContext

SPEC = ERNIE4_5_MOE  # tests/worker/sigmoid_moe_specs.py


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


def test_the_multi_token_prediction_weights_are_not_read(case: FamilyCase, tmp_path: Path) -> None:
    """Ernie 4.5 checkpoints carry ``mtp_*`` modules (transformers ignores them): skipped, not refused."""
    tensors = load_file(f"{case.model_dir}/model.safetensors")
    tensors["model.mtp_linear_proj.0.weight"] = torch.zeros(64, 128)
    tensors["model.mtp_block.0.mlp.gate.weight"] = torch.zeros(8, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((Path(case.model_dir) / "config.json").read_text())
    model = load_model(tmp_path, ModelConfig.from_pretrained(tmp_path), ParallelContext.single(), torch.float32)
    assert len(model.model.layers) == 3
