"""Published 8-bit checkpoints' routed experts (worker/layers/moe_w8.py), against ``transformers`` on the
checkpoint's reference dequantization.

Checkpoints with one module per expert, written in the formats' exact on-disk layouts
(tests/worker/w8a16_checkpoints.py: GPTQ 8-bit by the documented packing routine checked against
AutoGPTQ's reference dequantization, compressed-tensors W8A16 by the library), each checked by
tests/worker/moe_family_check.py (every greedy token, logits and prompt logprobs within 1e-4 in float32, alone
and 16 at once, the expert counts; a prompt alone and in the batch within ``BATCH_BOUND`` = 5e-5, as for the
4-bit experts: the dense and expert kernels pick their paths by row count):

* GPTQ ``bits: 8`` symmetric, group 32, on Qwen3-MoE (grouped: a byte a code and ``(s, o)`` per group, the w8
  kernel), tp 1 and 2, expert-parallel at tp 2, and through the Triton experts (the stack dequantized for the
  kernel; Triton's interpreter off CUDA);
* GPTQ 8-bit per channel, symmetric (``group_size: -1``, ``gptq_v2``), on Mixtral: the experts become int8 experts
  exactly (``q - 128``, the int8 kernel), tp 1 and 2;
* compressed-tensors W8A16 asymmetric, group 32, on Qwen3-MoE (grouped, zero points kept), tp 1 and 2;
* GPTQ 8-bit asymmetric act-order (a random column order per expert, shared by its w1 and w3) on Mixtral: tp 1 and
  expert-parallel at tp 2 (tensor-parallel at tp 2 spreads down's groups over the ranks: refused, as for 4-bit).

Also: the stacks' layouts and bytes (int8 ``(E, N, K)`` with per-row scales: 1 + 4 / K bytes a weight; grouped
uint8 with ``(E, N, K / G, 2)`` pairs: 1 + 8 / G), and corrupt checkpoints refused at load naming the tensor
(a symmetric zero point of 129); groups of 16 columns refused by the config's ``group_size``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model
from tests.worker.int8_checkpoints import MOE_LINEAR_WEIGHT
from tests.worker.loader_helpers import _rewrite
from tests.worker.moe_family_check import (FamilyCase, check_job, check_records, records_by_degree,
                                           reference_case, served_jobs, triton_job, with_expert_parallel)
from tests.worker.moe_specs import MIXTRAL_SPEC, QWEN3_MOE_INT4
from tests.worker.tp_harness import Job
from tests.worker.w8a16_checkpoints import save_compressed_tensors_w8a16, save_gptq8
from tpserve.model_config import ModelConfig
from worker.layers.moe import FusedMoE
from worker.loader import load_model
from worker.parallel_state import ParallelContext

FAMILIES = {"mixtral": (MIXTRAL_SPEC, {0, 1}, 2), "qwen3_moe": (QWEN3_MOE_INT4, {0}, 2)}
EXPERT_WEIGHT = re.compile(r".*\.experts\.\d+\.w[123]\.weight$")
#: name -> (family, writer of (checkpoint, dequantized reference)).
CHECKPOINTS = {
    "qwen3_moe_gptq8": ("qwen3_moe", lambda src, t, d: save_gptq8(src, t, d, group=32, sym=True,
                                                                  pattern=MOE_LINEAR_WEIGHT)),
    "mixtral_gptq8_channel": ("mixtral", lambda src, t, d: save_gptq8(src, t, d, group=-1, sym=True,
                                                                      checkpoint_format="gptq_v2",
                                                                      pattern=MOE_LINEAR_WEIGHT)),
    "qwen3_moe_ct8": ("qwen3_moe", lambda src, t, d: save_compressed_tensors_w8a16(
        src, t, d, strategy="group", symmetric=False, group=32, pattern=MOE_LINEAR_WEIGHT)),
    "mixtral_gptq8_act_order": ("mixtral", lambda src, t, d: save_gptq8(
        src, t, d, group=32, sym=False, desc_act=True, seed=3, pattern=MOE_LINEAR_WEIGHT, act_order=EXPERT_WEIGHT)),
}
TP1_ONLY = {"mixtral_gptq8_act_order"}
EXPERT_PARALLEL = ["qwen3_moe_gptq8", "mixtral_gptq8_act_order"]
TRITON = ["qwen3_moe_gptq8"]
BATCH_BOUND = 5e-5


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[FamilyCase, tuple[Job, Job]]]:
    """name -> (the reference case on the dequantized checkpoint, model_dir the 8-bit one; its jobs)."""
    root = tmp_path_factory.mktemp("moe_w8")
    sources = {name: save_tiny_model(spec, root / name) for name, (spec, _, _) in FAMILIES.items()}
    out = {}
    for name, (family, write) in CHECKPOINTS.items():
        spec, layers, top_k = FAMILIES[family]
        checkpoint, reference = write(sources[family], root / name, root / f"{name}_dequantized")
        case = dataclasses.replace(reference_case(spec, reference, layers, top_k), model_dir=str(checkpoint))
        out[name] = (case, served_jobs(case, name, None))  # 8-bit by its config.json alone
    return out


@pytest.fixture(scope="module")
def records_at(cases):
    return records_by_degree(cases, tp1_only=TP1_ONLY, expert_parallel=EXPERT_PARALLEL, triton=TRITON)


@pytest.mark.parametrize(("name", "tp"), [(name, tp) for name in CHECKPOINTS for tp in (1, 2)
                                         if tp == 1 or name not in TP1_ONLY])
def test_8_bit_experts_match_transformers_on_dequantized_weights(tp: int, name: str, cases, records_at) -> None:
    case, jobs = cases[name]
    check_records(case, jobs, records_at(tp), batch_bound=BATCH_BOUND)


@pytest.mark.parametrize("name", EXPERT_PARALLEL)
def test_8_bit_experts_with_expert_parallelism_at_tp2(name: str, cases, records_at) -> None:
    case, jobs = cases[name]
    check_records(case, with_expert_parallel(jobs), records_at(2), batch_bound=BATCH_BOUND)


@pytest.mark.parametrize("name", TRITON)
def test_8_bit_experts_through_the_triton_kernel_at_tp2(name: str, cases, records_at) -> None:
    case, jobs = cases[name]
    triton = triton_job(jobs[1], name)
    check_job(case, triton, records_at(2)[triton.name])


def _load(model_dir: str | Path, ctx: ParallelContext | None = None) -> list[FusedMoE]:
    model = load_model(model_dir, ModelConfig.from_pretrained(model_dir), ctx or ParallelContext.single(),
                       torch.float32)
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def test_per_channel_experts_are_int8_experts_exactly(cases) -> None:
    """Mixtral, GPTQ 8-bit per channel: int8 stacks ``(E, 2I, H)`` / ``(E, H, I)`` with one float32 scale a row;
    dequantized, the reference checkpoint's expert weights bit for bit; 1 + 4 / K bytes a weight."""
    case, _ = cases["mixtral_gptq8_channel"]
    float_experts = _load(Path(case.model_dir).parent / "mixtral_gptq8_channel_dequantized")
    for moe, ref in zip(_load(case.model_dir), float_experts, strict=True):
        assert moe.gate_up_proj.dtype == moe.down_proj.dtype == torch.int8
        assert tuple(moe.gate_up_proj.shape) == (8, 128, 64) and tuple(moe.down_proj.shape) == (8, 64, 64)
        assert tuple(moe.gate_up_proj_scale.shape) == (8, 128) and tuple(moe.down_proj_scale.shape) == (8, 64)
        assert torch.equal(moe.gate_up_proj.float() * moe.gate_up_proj_scale[..., None], ref.gate_up_proj)
        assert torch.equal(moe.down_proj.float() * moe.down_proj_scale[..., None], ref.down_proj)


def test_grouped_experts_hold_a_byte_a_code(cases) -> None:
    """Qwen3-MoE, compressed-tensors W8A16 group 32: uint8 ``(E, 2I, H)`` / ``(E, H, I)`` with ``(s, o)`` pairs per
    group; ``s * q + o`` is the reference's expert weights within float32 rounding; 1 + 8 / 32 bytes a weight;
    at tp 2 a rank holds tp 1's gate rows 32-63 and down columns 32-63 (their groups whole)."""
    case, _ = cases["qwen3_moe_ct8"]
    (ref,) = _load(Path(case.model_dir).parent / "qwen3_moe_ct8_dequantized")
    (moe,) = _load(case.model_dir)
    assert moe.gate_up_proj.dtype == moe.down_proj.dtype == torch.uint8
    assert tuple(moe.gate_up_proj.shape) == (8, 128, 64) and tuple(moe.down_proj.shape) == (8, 64, 64)
    assert tuple(moe.gate_up_proj_scale.shape) == (8, 128, 2, 2) and tuple(moe.down_proj_scale.shape) == (8, 64, 2, 2)
    for q, so, w in ((moe.gate_up_proj, moe.gate_up_proj_scale, ref.gate_up_proj),
                     (moe.down_proj, moe.down_proj_scale, ref.down_proj)):
        groups = q.float().reshape(*q.shape[:2], 2, 32)
        torch.testing.assert_close((groups * so[..., :1] + so[..., 1:]).reshape(q.shape), w, atol=1e-6, rtol=0)
    held = sum(p.numel() * p.element_size() for p in (moe.gate_up_proj, moe.down_proj, moe.gate_up_proj_scale,
                                                      moe.down_proj_scale))
    floats = sum(p.numel() * 4 for p in (ref.gate_up_proj, ref.down_proj))
    assert held / floats == pytest.approx((1 + 8 / 32) / 4, abs=1e-9)
    (rank1,) = _load(case.model_dir, ParallelContext(1, 2, torch.device("cpu")))
    assert torch.equal(rank1.gate_up_proj[:, :32], moe.gate_up_proj[:, 32:64])
    assert torch.equal(rank1.down_proj, moe.down_proj[:, :, 32:])
    assert torch.equal(rank1.down_proj_scale, moe.down_proj_scale[:, :, 1:])


def test_act_order_8_bit_experts_split_over_tensor_parallel_ranks_are_refused(cases) -> None:
    model_dir = cases["mixtral_gptq8_act_order"][0].model_dir
    with pytest.raises(ValueError, match=r"^model\.layers\.\d+\.\S*experts\.\d+\.w2: act-order \(its g_idx, "
                                         r"desc_act / actorder\) spreads groups "
                                         r"over the ranks' "
                                         r"input columns at tensor_parallel_size=2"):
        _load(model_dir, ParallelContext(1, 2, torch.device("cpu")))


def test_a_symmetric_zero_point_other_than_128_is_refused_naming_the_tensor(cases, tmp_path: Path) -> None:
    model_dir = Path(cases["mixtral_gptq8_channel"][0].model_dir)
    name = "model.layers.1.block_sparse_moe.experts.6.w2.qzeros"

    def corrupt(tensors: dict) -> None:
        tensors[name] = tensors[name].clone()
        tensors[name][0, 0] += 1  # v2 zero points stored as they are: one byte of the first word becomes 129

    broken = _rewrite(model_dir, tmp_path / "broken", corrupt)
    with pytest.raises(ValueError, match=rf"{re.escape(name)}: symmetric 8-bit zero points must be 128, found 129"):
        _load(broken)


def test_groups_not_a_multiple_of_32_are_refused_naming_group_size(tmp_path: Path) -> None:
    """An 8-bit checkpoint of groups of 16 columns: refused by its config's ``group_size`` (the coordinator's check,
    before any rank starts), never served."""
    source = save_tiny_model(MIXTRAL_SPEC, tmp_path / "mixtral")
    checkpoint, _ = save_gptq8(source, tmp_path / "g16", tmp_path / "g16_dq", group=16, sym=True,
                               pattern=MOE_LINEAR_WEIGHT)
    with pytest.raises(ValueError, match=r"gptq group_size=16 \(groups must be a multiple of 32 input columns"):
        _load(checkpoint)


def test_an_expert_stored_unquantized_beside_packed_ones_is_refused(cases, tmp_path: Path) -> None:
    """One expert's down projection stored float in an 8-bit checkpoint: refused naming it, never quantized at load."""
    model_dir = Path(cases["qwen3_moe_gptq8"][0].model_dir)
    stem = "model.layers.0.mlp.experts.3.down_proj"

    def unquantize(tensors: dict) -> None:
        for suffix in ("qweight", "qzeros", "scales", "g_idx"):
            tensors.pop(f"{stem}.{suffix}", None)
        tensors[f"{stem}.weight"] = torch.randn(64, 64)

    broken = _rewrite(model_dir, tmp_path / "broken", unquantize)
    with pytest.raises(ValueError, match=rf"'{re.escape(stem)}.weight' is stored unquantized in a packed checkpoint "
                                         "beside packed experts of the same layer"):
        _load(broken)
