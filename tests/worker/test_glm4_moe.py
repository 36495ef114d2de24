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

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.worker.moe_family_check import FamilyCase, at_once_job, build_case, check_family, check_job
from tests.worker.sigmoid_moe_specs import GLM4_MOE
from tests.worker.tp_harness import run_jobs
from tpserve.model_config import ModelConfig
from worker.kernels.triton_moe import grouped_experts_triton
from worker.layers import moe
from worker.loader import load_model
from worker.parallel_state import ParallelContext

SPEC = GLM4_MOE  # tests/worker/sigmoid_moe_specs.py


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


def test_the_multi_token_prediction_layer_is_not_read(case: FamilyCase, tmp_path: Path) -> None:
    """GLM-4.5 checkpoints append an MTP layer (``model.layers.{num_hidden_layers}.``): skipped, not refused."""
    tensors = load_file(f"{case.model_dir}/model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.2.mlp.experts.0.gate_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((Path(case.model_dir) / "config.json").read_text())
    model = load_model(tmp_path, ModelConfig.from_pretrained(tmp_path), ParallelContext.single(), torch.float32)
    assert len(model.model.layers) == 2
