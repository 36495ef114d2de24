"""Mixtral (worker/models/mixtral.py) against ``transformers`` at tensor-parallel degrees 1, 2 and 4.

See tests/worker/moe_family_check.py for what is checked. The tiny model has 8
experts, top-2, every layer sparse; 4 attention heads over 2 KV heads. Also here, as
the family every path shares: a missing expert tensor's name, the
decode graphs' padding rows in the expert counts, and the CUDA path's Triton experts
(in Triton's interpreter) inside the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.worker.moe_specs import MIXTRAL_SPEC as SPEC
from tests.worker.moe_family_check import FamilyCase, at_once_job, build_case, check_family, check_job
from tests.worker.tp_harness import run_jobs
from tpserve.model_config import ModelConfig
from worker.kernels.triton_moe import grouped_experts_triton
from worker.layers import moe
from worker.loader import load_model
from worker.parallel_state import ParallelContext


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> FamilyCase:
    return build_case(SPEC, tmp_path_factory.mktemp("mixtral"), moe_layers={0, 1}, top_k=2)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mixtral_matches_transformers(case: FamilyCase, tp: int) -> None:
    check_family(case, tp)


def test_a_missing_expert_tensor_is_named_as_the_checkpoint_names_it(case: FamilyCase, tmp_path: Path) -> None:
    tensors = load_file(f"{case.model_dir}/model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((Path(case.model_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match=r"missing weights: \['model.layers.1.block_sparse_moe.experts.3.w2.weight'\]"):
        load_model(tmp_path, ModelConfig.from_pretrained(tmp_path), ParallelContext.single(), torch.float32)


def test_decode_graph_padding_rows_are_not_counted(case: FamilyCase) -> None:
    """3 sequences decode 4 steps through graphs of 4 rows: the padding row routes too, and is subtracted."""
    job = at_once_job(case, num_prompts=3, num_steps=5, graph_size=4)
    check_job(case, job, run_jobs([job], tp_size=1)[job.name])


def test_the_triton_experts_serve_the_model(case: FamilyCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's grouped kernel (Triton's interpreter here) inside the model: same tokens and logits."""
    monkeypatch.setattr(moe, "grouped_experts", grouped_experts_triton)
    job = at_once_job(case, num_prompts=3, num_steps=4)
    check_job(case, job, run_jobs([job], tp_size=1)[job.name])
