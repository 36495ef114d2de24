"""Int4 routed experts, against ``transformers`` on the dequantized float model.

Two sources, two families (Mixtral: experts ``w1/w2/w3``, every layer sparse; Qwen3-MoE: a dense
layer beside the sparse one), each checked by tests/worker/moe_family_check.py (every greedy
token, logits and prompt logprobs within 1e-4 in float32, alone and 16 at once, the expert counts;
a prompt's logits alone and in the batch within ``BATCH_BOUND`` = 5e-5 rather than 1e-5, measured
1.4e-5: the int4 kernel picks its path by row count (GEMV passes of up to 8 rows, then chunks up to
64, beyond that the layer dequantized once and ``at::matmul``; AMX / VNNI where present, x as 24-bit
fixed point), so a token's float32 sums are grouped differently alone and in a batch, in the dense
int4 layers as in the experts):

* ``--quantization int4`` on the float checkpoint (RTN, groups of 32 here: no input size of the
  tiny models divides by 128): the reference is ``transformers`` on the checkpoint whose expert
  and dense linear weights are replaced by their int4 round trip (tests/worker/int4_checkpoints.py,
  written from the definition); Mixtral and Qwen3-MoE at tp 1 and 2, with
  ``--enable-expert-parallel`` at tp 2, and Mixtral's through the Triton experts at tp 2
  (Triton's interpreter off CUDA: the int4 stack dequantized for the kernel); the other families whose
  routed experts are ``FusedMoE`` (Qwen2-MoE with its gated shared expert; GLM-4.5, MiniMax-M2 and
  ERNIE 4.5: sigmoid routers, ungated shared experts) at tp 1;
* 4-bit checkpoints with one module per expert, written in the formats' exact on-disk layouts
  (GPTQ and AWQ by the documented packing routines checked against AutoGPTQ's and AutoAWQ's
  reference dequantization, compressed-tensors ``pack-quantized`` by the library): GPTQ
  symmetric group 32 and compressed-tensors asymmetric group 32 on Qwen3-MoE, AWQ group 32 on
  Mixtral, at tp 1 and 2 (GPTQ also expert-parallel at tp 2); act-order GPTQ experts (asymmetric,
  a random column order per expert, shared by its w1 and w3) on Mixtral at tp 1 and expert-parallel
  at tp 2 (whole experts; also through the Triton experts), refused tensor-parallel at tp 2 (the
  random order spreads down's groups over the ranks' columns); the reference is the format's
  reference dequantization;
* a GPTQ Qwen3-MoE whose routed experts are stored float (GPTQModel's ``dynamic`` ``-:`` rule): the experts
  are served in float as stored, the attention and dense MLP packed, tp 1 and 2 and expert-parallel;
* the experts are held packed: uint8 codes with float32 (scale, offset) pairs, their bytes
  1/8 of float32 plus 2 / G (0.1875 at G = 32); an expert-parallel rank holds tp 1's experts;
* act-order experts whose gate and up orders differ, and gpt-oss's and Llama 4's fused layouts with
  int4, are refused in one line.

The tiny models' experts (64 wide, groups of 32) stay row-major; the AMX tile layout of expert stacks whose
shapes qualify is checked by tests/worker/test_moe_int4_tiles.py.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from tests.tiny_models import TinyModelSpec, save_tiny_model
from tests.worker.int4_checkpoints import save_awq, save_compressed_tensors_w4a16, save_gptq, save_rtn_dequantized
from tests.worker.int8_checkpoints import MOE_LINEAR_WEIGHT
from tests.worker.loader_helpers import _rewrite
from tests.worker.moe_family_check import (FamilyCase, check_job, check_records, records_by_degree,
                                           reference_case, served_jobs, triton_job, with_expert_parallel)
from tests.worker.moe_specs import MIXTRAL_SPEC, QWEN2_MOE_SPEC, QWEN3_MOE_INT4
from tests.worker.shard_fakes import ShardOnlyContext
from tests.worker.sigmoid_moe_specs import ERNIE4_5_MOE, GLM4_MOE, MINIMAX_M2
from tests.worker.tp_harness import Job, run_jobs
from tpserve.model_config import ModelConfig
from worker.layers.moe import FusedMoE
from worker.layers.moe_stacked import StackedFusedMoE
from worker.loader import load_model
from worker.model_runner import ModelRunner
from worker.models.llama4 import Llama4Experts
from worker.parallel_state import ParallelContext

FAMILIES = {"mixtral": (MIXTRAL_SPEC, {0, 1}, 2), "qwen3_moe": (QWEN3_MOE_INT4, {0}, 2)}
#: The other families whose routed experts are :class:`FusedMoE` (checked at tp 1 only: CI time).
OTHER_FAMILIES = {"qwen2_moe": (QWEN2_MOE_SPEC, {1}, 4), "glm4_moe": (GLM4_MOE, {1}, 3),
                  "minimax_m2": (MINIMAX_M2, {0, 1}, 2), "ernie4_5_moe": (ERNIE4_5_MOE, {1}, 3)}
#: 4-bit checkpoints: name -> (family, writer of (checkpoint, dequantized reference)).
CHECKPOINTS = {
    "qwen3_moe_gptq": ("qwen3_moe", lambda src, t, d: save_gptq(src, t, d, group=32, sym=True, desc_act=False,
                                                                pattern=MOE_LINEAR_WEIGHT)),
    "mixtral_awq": ("mixtral", lambda src, t, d: save_awq(src, t, d, group=32, pattern=MOE_LINEAR_WEIGHT)),
    "qwen3_moe_ct": ("qwen3_moe", lambda src, t, d: save_compressed_tensors_w4a16(
        src, t, d, strategy="group", symmetric=False, group=32, pattern=MOE_LINEAR_WEIGHT)),
    "mixtral_gptq_act_order": ("mixtral", lambda src, t, d: save_act_order_gptq(src, t, d)),
    "qwen3_moe_gptq_float_experts": ("qwen3_moe", lambda src, t, d: save_gptq(
        src, t, d, group=32, sym=True, desc_act=False, pattern=NOT_EXPERTS,
        dynamic={r"-:.*\.mlp\.experts\..*": {}})),
}
RTN = [f"{name}_rtn" for name in FAMILIES]
#: Served at tp 1 and expert-parallel at tp 2 only (tensor-parallel at tp 2 is refused: see below).
TP1_ONLY = {"mixtral_gptq_act_order"}
EXPERT_PARALLEL = [*RTN, "qwen3_moe_gptq", "mixtral_gptq_act_order", "qwen3_moe_gptq_float_experts"]
EXPERT_WEIGHT = re.compile(r".*\.experts\.\d+\.w[123]\.weight$")
#: Every linear weight but the routed experts' (a checkpoint whose experts GPTQModel's ``-:`` rule left float).
NOT_EXPERTS = re.compile(r"^(?!.*\.experts\.).*_proj\.weight$")
BATCH_BOUND = 5e-5


def save_act_order_gptq(source: Path, target: Path, dequantized: Path) -> tuple[Path, Path]:
    """Mixtral as GPTQ, asymmetric, group 32, ``desc_act``: the experts in a random column order each (w1 and w3
    sharing theirs), the attention layers in order (so the tensor-parallel attention is servable at tp 2)."""
    return save_gptq(source, target, dequantized, group=32, sym=False, desc_act=True, seed=3,
                     pattern=MOE_LINEAR_WEIGHT, act_order=EXPERT_WEIGHT)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_int4")
    return {name: save_tiny_model(spec, root / name) for name, (spec, _, _) in FAMILIES.items()}


@pytest.fixture(scope="module")
def cases(sources: dict[str, Path]) -> dict[str, tuple[FamilyCase, tuple[Job, Job]]]:
    """name -> (the reference case on the dequantized checkpoint, model_dir the served one; its jobs)."""
    out = {}
    for family, (spec, layers, top_k) in FAMILIES.items():
        out[f"{family}_rtn"] = _rtn_case(spec, layers, top_k, sources[family], f"{family}_rtn")
    for name, (family, write) in CHECKPOINTS.items():
        spec, layers, top_k = FAMILIES[family]
        source = sources[family]
        checkpoint, reference = write(source, source.parent / name, source.parent / f"{name}_dequantized")
        case = dataclasses.replace(reference_case(spec, reference, layers, top_k), model_dir=str(checkpoint))
        out[name] = (case, served_jobs(case, name, None))  # int4 by its config.json alone
    return out


def _rtn_case(spec: TinyModelSpec, layers: set[int], top_k: int, source: Path, name: str
              ) -> tuple[FamilyCase, tuple[Job, Job]]:
    """``--quantization int4`` on the float checkpoint ``source``; the reference on its int4 round trip."""
    reference = save_rtn_dequantized(source, source.parent / f"{name}_dequantized", MOE_LINEAR_WEIGHT)
    case = dataclasses.replace(reference_case(spec, reference, layers, top_k), model_dir=str(source))
    return case, served_jobs(case, name, "int4")


TRITON = ["mixtral_rtn", "mixtral_gptq_act_order"]


@pytest.fixture(scope="module")
def records_at(cases):
    return records_by_degree(cases, tp1_only=TP1_ONLY, expert_parallel=EXPERT_PARALLEL, triton=TRITON)


@pytest.mark.parametrize(("name", "tp"), [(name, tp) for name in [*RTN, *CHECKPOINTS] for tp in (1, 2)
                                         if tp == 1 or name not in TP1_ONLY])
def test_int4_experts_match_transformers_on_dequantized_weights(tp: int, name: str, cases, records_at) -> None:
    case, jobs = cases[name]
    check_records(case, jobs, records_at(tp), batch_bound=BATCH_BOUND)


@pytest.mark.parametrize("name", EXPERT_PARALLEL)
def test_int4_experts_with_expert_parallelism_at_tp2(name: str, cases, records_at) -> None:
    case, jobs = cases[name]
    check_records(case, with_expert_parallel(jobs), records_at(2), batch_bound=BATCH_BOUND)


@pytest.mark.parametrize("name", TRITON)
def test_int4_experts_through_the_triton_kernel_at_tp2(name: str, cases, records_at) -> None:
    case, jobs = cases[name]
    triton = triton_job(jobs[1], name)
    check_job(case, triton, records_at(2)[triton.name])


def test_other_fused_moe_families_int4_at_tp1(tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("moe_int4_others")
    cases = {name: _rtn_case(spec, layers, top_k, save_tiny_model(spec, root / name), name)
             for name, (spec, layers, top_k) in OTHER_FAMILIES.items()}
    records = run_jobs([job for _, jobs in cases.values() for job in jobs], tp_size=1)
    for case, jobs in cases.values():
        check_records(case, jobs, records, batch_bound=BATCH_BOUND)


def _expert_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for module in model.modules() if isinstance(module, FusedMoE)
               for p in module.parameters())


def test_int4_experts_are_packed_in_memory(sources: dict[str, Path]) -> None:
    """Mixtral tp 1, ``--quantization int4``: every expert stack uint8 ``(E, 2I, H / 2)`` / ``(E, H, I / 2)`` with
    float32 (scale, offset) pairs ``(E, 2I, H / 32, 2)`` / ``(E, H, I / 32, 2)``; the router float32; the experts'
    bytes are 1/8 of float32 plus 2 / G: 0.1875 at G = 32."""
    float_model = ModelRunner(str(sources["mixtral"]), ParallelContext.single(), torch.float32, 4).model
    int4_model = ModelRunner(str(sources["mixtral"]), ParallelContext.single(), torch.float32, 4,
                             quantization="int4").model
    experts = [m for m in int4_model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2
    for moe in experts:
        assert moe.gate_up_proj.dtype == moe.down_proj.dtype == torch.uint8
        assert tuple(moe.gate_up_proj.shape) == (8, 128, 32) and tuple(moe.down_proj.shape) == (8, 64, 32)
        assert moe.gate_up_proj_scale.dtype == moe.down_proj_scale.dtype == torch.float32
        assert tuple(moe.gate_up_proj_scale.shape) == (8, 128, 2, 2)
        assert tuple(moe.down_proj_scale.shape) == (8, 64, 2, 2)
        assert bool((moe.gate_up_proj_scale[..., 0] > 0).all())  # every group's scale written
        # symmetric RTN: offset -8 s, and the codes span [1, 15] (the group's largest |w| is +-7 s)
        torch.testing.assert_close(moe.down_proj_scale[..., 1], -8 * moe.down_proj_scale[..., 0])
    gates = [p for n, p in int4_model.named_parameters() if n.endswith("gate.weight")]
    assert gates and all(p.dtype == torch.float32 for p in gates)
    ratio = _expert_bytes(int4_model) / _expert_bytes(float_model)
    assert ratio == pytest.approx(1 / 8 + 2 / 32, abs=1e-9), ratio


def test_int4_expert_parallel_rank_holds_its_experts_packed(sources: dict[str, Path]) -> None:
    """tp 2 with expert parallelism, rank 1 loaded alone: experts 4-7 whole, equal to tp 1's; tensor-parallel rank 1
    holds tp 1's gate rows 32-63 and down columns 32-63 (the second of its two groups of 32: groups never cross ranks)."""
    model_dir = sources["mixtral"]
    config = ModelConfig.from_pretrained(model_dir)
    whole = load_model(model_dir, config, ParallelContext.single(), torch.float32, quantization="int4")
    part = load_model(model_dir, config, ParallelContext(1, 2, torch.device("cpu"), enable_expert_parallel=True),
                      torch.float32, quantization="int4")
    split = load_model(model_dir, config, ParallelContext(1, 2, torch.device("cpu")), torch.float32,
                       quantization="int4")
    pairs = zip([m for m in whole.modules() if isinstance(m, FusedMoE)],
                [m for m in split.modules() if isinstance(m, FusedMoE)],
                [m for m in part.modules() if isinstance(m, FusedMoE)], strict=True)
    for full, tp_moe, ep_moe in pairs:
        assert torch.equal(tp_moe.down_proj, full.down_proj[:, :, 16:])  # bytes 16-31: columns 32-63
        assert torch.equal(tp_moe.down_proj_scale, full.down_proj_scale[:, :, 1:])
        assert torch.equal(tp_moe.gate_up_proj[:, :32], full.gate_up_proj[:, 32:64])
        assert torch.equal(tp_moe.gate_up_proj_scale[:, :32], full.gate_up_proj_scale[:, 32:64])
        assert ep_moe.first_expert == 4 and ep_moe.gate_up_proj.dtype == torch.uint8
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_scale", "down_proj_scale"):
            assert torch.equal(getattr(ep_moe, name), getattr(full, name)[4:]), name


def test_act_order_experts_load_per_expert_orders(cases) -> None:
    """tp 1: every expert's gate/up and down columns in its own packed order (a permutation; not the identity)."""
    model_dir = cases["mixtral_gptq_act_order"][0].model_dir
    model = load_model(model_dir, ModelConfig.from_pretrained(model_dir), ParallelContext.single(), torch.float32)
    for moe in [m for m in model.modules() if isinstance(m, FusedMoE)]:
        assert tuple(moe.gate_up_perm.shape) == (8, 64) and tuple(moe.down_perm.shape) == (8, 64)
        for perm in (*moe.gate_up_perm, *moe.down_perm):
            assert torch.equal(perm.sort().values, torch.arange(64)) and not torch.equal(perm, torch.arange(64))


def test_act_order_experts_split_over_tensor_parallel_ranks_are_refused(cases) -> None:
    model_dir = cases["mixtral_gptq_act_order"][0].model_dir
    config = ModelConfig.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"^model\.layers\.\d+\.\S*experts\.\d+\.w2: act-order \(its g_idx, "
                                         r"desc_act / actorder\) spreads groups "
                                         r"over the ranks' "
                                         r"input columns at tensor_parallel_size=2"):
        load_model(model_dir, config, ParallelContext(1, 2, torch.device("cpu")), torch.float32)


def test_act_order_gate_and_up_in_different_orders_are_refused(cases, tmp_path: Path) -> None:
    model_dir = Path(cases["mixtral_gptq_act_order"][0].model_dir)
    w3 = "model.layers.1.block_sparse_moe.experts.5.w3.g_idx"

    def reorder(tensors: dict) -> None:
        tensors[w3] = tensors[w3].flip(0).contiguous()  # another valid order: the same groups, reversed columns

    broken = _rewrite(model_dir, tmp_path / "broken", reorder)
    with pytest.raises(ValueError, match=r"experts\.5\.w[13]\.\w+: g_idx differs between the expert's gate and up"):
        load_model(broken, ModelConfig.from_pretrained(broken), ParallelContext.single(), torch.float32)


def test_rtn_groups_that_do_not_split_an_expert_slice_are_refused() -> None:
    """Experts 256 wide (RTN groups of 128) at tp 4: a rank's 64 down columns hold half a group: refused in one line
    pointing at expert parallelism (whole experts), as Qwen3-30B-A3B's 768-wide experts at tp 4 or 8 would be."""
    moe = FusedMoE(2, 32, 256, ShardOnlyContext(tp_rank=1, tp_size=4, device=torch.device("cpu")),
                   dtype=torch.float32, quantization="int4")
    moe.weight_loader(moe.gate_up_proj, torch.zeros(256, 32), (0, "gate"))  # rows: any slice quantizes alone
    with pytest.raises(ValueError, match="--quantization int4 groups of 128 columns do not split this rank's 64 "
                                         r"expert columns: use --enable-expert-parallel \(whole experts per rank\)"):
        moe.weight_loader(moe.down_proj, torch.zeros(32, 256), (0, "down"))


def test_fused_expert_layouts_refuse_int4() -> None:
    """gpt-oss's stacked experts (with biases) and Llama 4's fused tensors fill float stacks only: one line each."""
    ctx = ParallelContext.single()
    for experts in (StackedFusedMoE, Llama4Experts):
        with pytest.raises(ValueError, match="--quantization int4 is not supported for mixture-of-experts models "
                                             f"whose experts are {experts.checkpoint_layout} \\(a checkpoint layout"):
            experts(4, 32, 32, ctx, dtype=torch.float32, quantization="int4")
