"""``--enable-expert-parallel`` on whole models: Mixtral, Qwen3-MoE, Qwen2-MoE, GLM-4.5 and MiniMax-M2 at tp 2 and 4.

Each family's tiny checkpoint and ``transformers`` reference are the ones its own test
checks with the tensor-parallel split (tests/worker/test_mixtral.py, test_qwen3_moe.py,
test_qwen2_moe.py; the check is tests/worker/moe_family_check.py's): with whole experts
per rank the same greedy tokens as ``transformers`` (which the tensor-parallel split
also gives), logits and prompt logprobs within 1e-4, alone and 16 at once; a prompt's
logits alone and in the batch of 16 within 1e-5; every MoE layer's expert counts sum to
its tokens times top-k. The three families' jobs share one process group per degree.
Also at tp 2: the Triton experts (Triton's interpreter) and the decode graphs' buffers; at
tp 2 x pp 2 with pipeline stages. A separate test loads each rank's shard and reads its
parameters: only its experts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.worker.moe_family_check import (
    FamilyCase,
    at_once_job,
    build_case,
    check_job,
    check_records,
    expert_parallel_jobs,
)
from tests.worker.moe_specs import MIXTRAL_SPEC, QWEN2_MOE_SPEC, QWEN3_MOE_SPEC
from tests.worker.sigmoid_moe_specs import GLM4_MOE, MINIMAX_M2
from tests.worker.tp_harness import run_jobs
from tpserve.model_config import ModelConfig
from worker.layers.moe import FusedMoE
from worker.loader import load_model
from worker.memory import weight_bytes
from worker.parallel_state import ParallelContext

FAMILIES = {"mixtral": (MIXTRAL_SPEC, {0, 1}, 2), "qwen3_moe": (QWEN3_MOE_SPEC, {0}, 2),
            "qwen2_moe": (QWEN2_MOE_SPEC, {1}, 4),
            # sigmoid routing with groups and shared experts (the latter stay tensor-parallel); full-width QK norm
            "glm4_moe": (GLM4_MOE, {1}, 3), "minimax_m2": (MINIMAX_M2, {0, 1}, 2)}


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FamilyCase]:
    return {name: build_case(spec, tmp_path_factory.mktemp(name), moe_layers=layers, top_k=top_k)
            for name, (spec, layers, top_k) in FAMILIES.items()}


@pytest.mark.parametrize("tp", [2, 4])
def test_expert_parallel_matches_transformers(cases: dict[str, FamilyCase], tp: int) -> None:
    jobs = {name: expert_parallel_jobs(case) for name, case in cases.items()}
    records = run_jobs([job for pair in jobs.values() for job in pair], tp_size=tp)
    for name, case in cases.items():
        check_records(case, jobs[name], records)


def test_expert_parallel_triton_experts_and_decode_graphs(cases: dict[str, FamilyCase]) -> None:
    """At tp 2 with whole experts per rank: the CUDA path's grouped Triton experts (Triton's interpreter
    here) inside Mixtral, skipping other ranks' rows; and Mixtral's decode graphs' static
    buffers (3 sequences in graphs of 4 rows: the padding row routes, to some rank's expert, and is not
    counted). Same tokens and logits as ``transformers``."""
    triton = at_once_job(cases["mixtral"], num_prompts=3, num_steps=4)
    jobs = [("mixtral", dataclasses.replace(triton, name="mixtral_triton", enable_expert_parallel=True,
                                            triton_experts=True))]
    graphs = at_once_job(cases["mixtral"], num_prompts=3, num_steps=5, graph_size=4)
    jobs.append(("mixtral", dataclasses.replace(graphs, name="mixtral_graphs", enable_expert_parallel=True)))
    records = run_jobs([job for _, job in jobs], tp_size=2)
    for name, job in jobs:
        check_job(cases[name], job, records[job.name])


def _expert_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's per-expert tensors, by name."""
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys() if ".experts." in name}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_each_rank_holds_only_its_experts(cases: dict[str, FamilyCase], name: str, tp: int) -> None:
    """Rank ``r``'s stacks are exactly experts ``[r * E / tp, (r + 1) * E / tp)`` of the checkpoint, whole;
    its expert bytes are 1 / tp of the checkpoint's, and the dense and shared weights equal the tensor-parallel shard's."""
    model_dir = Path(cases[name].model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    tensors = _expert_tensors(model_dir)
    num_experts = 8
    per_rank = num_experts // tp
    for rank in range(tp):
        ep = load_model(model_dir, config, ParallelContext(rank, tp, torch.device("cpu"), enable_expert_parallel=True),
                        torch.float32)
        tp_split = load_model(model_dir, config, ParallelContext(rank, tp, torch.device("cpu")), torch.float32)
        layers = [(n, m) for n, m in ep.named_modules() if isinstance(m, FusedMoE)]
        assert layers
        for module_name, moe in layers:
            prefix = module_name  # "model.layers.{i}.mlp.experts"; the checkpoint's names come from the model
            inter = moe.intermediate_size
            assert moe.gate_up_proj.shape == (per_rank, 2 * inter, config.hidden_size)
            assert moe.down_proj.shape == (per_rank, config.hidden_size, inter)
            for slot in range(per_rank):
                e = rank * per_rank + slot
                gate, up, down = (tensors[ep.checkpoint_name(f"{prefix}.{param}", (e, kind))]
                                  for param, kind in (("gate_up_proj", "gate"), ("gate_up_proj", "up"),
                                                      ("down_proj", "down")))
                assert torch.equal(moe.gate_up_proj[slot], torch.cat([gate, up]))
                assert torch.equal(moe.down_proj[slot], down)
            held = sum(p.numel() * p.element_size() for p in moe.parameters())
            stored = sum(t.numel() * t.element_size() for n, t in tensors.items()
                         if n.startswith(ep.checkpoint_name(f"{prefix}.down_proj", (0, "down")).rsplit(".", 3)[0]))
            assert held * tp == stored
        # Everything but the experts is split as without the flag (attention, dense MLPs, shared expert).
        ep_params, tp_params = dict(ep.named_parameters()), dict(tp_split.named_parameters())
        assert ep_params.keys() == tp_params.keys()
        for key, value in ep_params.items():
            if ".experts." not in f".{key}":
                assert torch.equal(value, tp_params[key]), key
        assert weight_bytes(ep) == weight_bytes(tp_split)  # the same bytes per rank: 1 / tp of the experts


def test_expert_parallel_within_pipeline_stages(cases: dict[str, FamilyCase]) -> None:
    """tp 2 x pp 2: each stage's experts split whole over that stage's tensor-parallel group (Mixtral's
    two MoE layers, one per stage; Qwen2-MoE's dense layer 0 on stage 0, its MoE layer 1 on stage 1)."""
    from tests.worker.pp_harness import run_pipeline_layouts

    jobs = {name: expert_parallel_jobs(cases[name]) for name in ("mixtral", "qwen2_moe")}
    records = run_pipeline_layouts({(2, 2): [job for pair in jobs.values() for job in pair]})[(2, 2)]
    for name, pair in jobs.items():
        check_records(cases[name], pair, records, check_counts=False)  # the sampling rank counts its stage only
