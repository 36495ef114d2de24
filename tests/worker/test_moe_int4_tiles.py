"""Int4 routed experts in the tile layout (worker/layers/moe_int4.py; int4_matmul.py, repack_tile_stack).

* layer level: random expert stacks (8 experts, hidden 256, width 128, groups of 128) repacked expert by
  expert; :func:`grouped_experts_torch` on the tile stacks (``linear_int4`` per expert on 4-D scales: the
  tile kernel, AMX or VNNI) gives the row-major stacks' outputs within 1e-5 of max |y| at 1, 4 and 70 rows (70: more than
  the row-major kernel's 64-row cut-over to dequantize-and-matmul), and both within 1e-5 of max |y| of
  float64 on the dequantized weights; :func:`dequantize_int4_experts` reads both layouts to the same weights
  (exactly); act-order experts' column gathers give the same outputs on either layout; shapes the layout
  cannot hold are refused with the stack unchanged;
* model level: a Qwen3-MoE whose expert shapes qualify (hidden 256, experts 128 wide, RTN groups of 128),
  ``--quantization int4``: every expert stack loaded in the tile layout, holding the same codes and scales
  (and the same bytes) as the row-major load (``use_int4_tiles(False)``), an expert-parallel rank holding
  tp 1's experts 4-7; greedy tokens, logits and prompt logprobs against ``transformers`` on the int4 round
  trip (tests/worker/moe_family_check.py, bounds as tests/worker/test_moe_int4.py) at tp 1 and expert-parallel
  at tp 2 (tensor-parallel at tp 2 would split down's 128 columns below a group: refused, as documented), and
  through the Triton experts (Triton's interpreter at tp 1: the stacks widened from the tile layout).

The tile kernel needs AMX-INT8 or AVX512-VNNI: on another CPU the stacks stay row-major, and the tests that assert
the layout are skipped with that reason (the model-level check still runs, on the row-major layout).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.tiny_models import TinyModelSpec, save_tiny_model
from tests.worker.int4_checkpoints import save_rtn_dequantized
from tests.worker.int8_checkpoints import MOE_LINEAR_WEIGHT
from tests.worker.moe_family_check import FamilyCase, at_once_job, check_job, check_records, reference_case
from tests.worker.tp_harness import Job, run_jobs
from tpserve.model_config import ModelConfig
from worker.kernels import cpu_kernels_available
from worker.kernels.triton_moe import grouped_experts_triton
from worker.layers import moe
from worker.layers.int4_matmul import pack_codes, repack_tile_stack, tile_layout_layers
from worker.layers.moe import FusedMoE
from worker.layers.moe_experts import grouped_experts_torch
from worker.layers.moe_int4 import dequantize_int4_experts, unpermute_columns
from worker.loader import load_model
from worker.parallel_state import ParallelContext

#: Qwen3-MoE whose experts qualify for the tile layout: gate_up (16, 256 x 256) and down (256 x 128), groups 128.
QWEN3_MOE_TILES = TinyModelSpec("qwen3_moe_tiles", "qwen3_moe", {
    "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 180,
    "num_hidden_layers": 2, "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "tie_word_embeddings": False}, seed=31)
BATCH_BOUND = 5e-5  # a prompt alone against in the batch: tests/worker/test_moe_int4.py states why
EXPERTS, HIDDEN, WIDTH, GROUP = 8, 256, 128, 128


def _tiles_enabled() -> bool:
    return cpu_kernels_available() and bool(torch.ops.tpserve_cpu.int4_tiles_enabled())


needs_tiles = pytest.mark.skipif(not _tiles_enabled(),
                                 reason="this CPU has neither AMX-INT8 (given to this process) nor AVX512-VNNI")


def _stack(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random row-major int4 stack: ``(E, rows, cols / 2)`` uint8 and ``(E, rows, cols / G, 2)`` float32."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (EXPERTS * rows, cols), generator=gen)
    groups = cols // GROUP
    scale = torch.rand(EXPERTS, rows, groups, generator=gen) * 0.02 + 0.005
    offset = -8 * scale + torch.randn(EXPERTS, rows, groups, generator=gen) * 0.01
    return pack_codes(q).reshape(EXPERTS, rows, cols // 2), torch.stack([scale, offset], 3)


@needs_tiles
@pytest.mark.parametrize("rows", [1, 4, 70])
def test_tile_stacks_give_the_row_major_stacks_outputs(rows: int) -> None:
    gate_up, gate_up_so = _stack(2 * WIDTH, HIDDEN, seed=1)
    down, down_so = _stack(HIDDEN, WIDTH, seed=2)
    tile_gate_up, tile_down = gate_up.clone(), down.clone()
    tile_gate_up_so = repack_tile_stack(tile_gate_up, gate_up_so)
    tile_down_so = repack_tile_stack(tile_down, down_so)
    assert tile_gate_up_so.shape == (EXPERTS, 2 * WIDTH // 16, HIDDEN // GROUP, 2, 16)
    assert tile_down_so.shape == (EXPERTS, HIDDEN // 16, WIDTH // GROUP, 2, 16)
    assert not torch.equal(tile_gate_up, gate_up)  # the bytes moved

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:2] for _ in range(rows)])  # (T, 2) distinct experts
    weights = torch.rand(rows, 2, generator=gen)
    y_rows = grouped_experts_torch(x, gate_up, down, ids, weights, gate_up_scale=gate_up_so, down_scale=down_so)
    y_tiles = grouped_experts_torch(x, tile_gate_up, tile_down, ids, weights, gate_up_scale=tile_gate_up_so,
                                    down_scale=tile_down_so)
    w_gate_up = dequantize_int4_experts(gate_up, gate_up_so, torch.float64)  # (E, 2I, H)
    w_down = dequantize_int4_experts(down, down_so, torch.float64)  # (E, H, I)
    y64 = grouped_experts_torch(x.double(), w_gate_up, w_down, ids, weights.double())  # the float64 reference
    bound = 1e-5 * float(y64.abs().max())
    assert float((y_tiles - y_rows).abs().max()) <= bound
    assert float((y_tiles.double() - y64).abs().max()) <= bound
    assert float((y_rows.double() - y64).abs().max()) <= bound


@needs_tiles
def test_act_order_gathers_are_the_same_on_tile_stacks() -> None:
    """Act-order experts: each expert's input columns in a random packed order (``gate_up_perm (E, H)``,
    ``down_perm (E, I)``): gathers of x, so the tile stacks give the row-major outputs, and both float64's on
    the weights put back in the checkpoint's column order (:func:`unpermute_columns`), within 1e-5 of max |y|."""
    gate_up, gate_up_so = _stack(2 * WIDTH, HIDDEN, seed=6)
    down, down_so = _stack(HIDDEN, WIDTH, seed=7)
    tile_gate_up, tile_down = gate_up.clone(), down.clone()
    tile_gate_up_so, tile_down_so = repack_tile_stack(tile_gate_up, gate_up_so), repack_tile_stack(tile_down, down_so)
    gen = torch.Generator().manual_seed(8)
    gate_up_perm = torch.stack([torch.randperm(HIDDEN, generator=gen) for _ in range(EXPERTS)])  # (E, H)
    down_perm = torch.stack([torch.randperm(WIDTH, generator=gen) for _ in range(EXPERTS)])  # (E, I)
    x = torch.randn(4, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:2] for _ in range(4)])  # (4, 2)
    weights = torch.rand(4, 2, generator=gen)
    perms = {"gate_up_perm": gate_up_perm, "down_perm": down_perm}
    y_rows = grouped_experts_torch(x, gate_up, down, ids, weights, gate_up_scale=gate_up_so, down_scale=down_so,
                                   **perms)
    y_tiles = grouped_experts_torch(x, tile_gate_up, tile_down, ids, weights, gate_up_scale=tile_gate_up_so,
                                    down_scale=tile_down_so, **perms)
    w_gate_up = unpermute_columns(dequantize_int4_experts(tile_gate_up, tile_gate_up_so, torch.float64), gate_up_perm)
    w_down = unpermute_columns(dequantize_int4_experts(tile_down, tile_down_so, torch.float64), down_perm)
    y64 = grouped_experts_torch(x.double(), w_gate_up, w_down, ids, weights.double())
    bound = 1e-5 * float(y64.abs().max())
    assert float((y_tiles - y_rows).abs().max()) <= bound
    assert float((y_tiles.double() - y64).abs().max()) <= bound


@needs_tiles
def test_dequantizing_either_layout_of_a_stack_gives_the_same_weights() -> None:
    down, down_so = _stack(HIDDEN, WIDTH, seed=3)
    tiles = down.clone()
    tiles_so = repack_tile_stack(tiles, down_so)
    row_major = dequantize_int4_experts(down, down_so, torch.float32)  # (E, H, I)
    assert row_major.shape == (EXPERTS, HIDDEN, WIDTH)
    assert torch.equal(dequantize_int4_experts(tiles, tiles_so, torch.float32), row_major)
    # expert 5's row 17, column 116: code of the row-major packing, s * q + o
    q = int(down[5, 17, 52] >> 4)  # column 116 = 32 * 3 + 16 + 4: block 3's byte 4, high nibble
    s, o = down_so[5, 17, 0].tolist()
    assert float(row_major[5, 17, 116]) == pytest.approx(s * q + o, rel=1e-6)


def test_shapes_the_tile_layout_cannot_hold_are_refused_unchanged() -> None:
    gate_up, so = _stack(24, HIDDEN, seed=4)  # 24 rows: not a multiple of 16
    before = gate_up.clone()
    with pytest.raises(ValueError, match="rows a multiple of 16"):
        repack_tile_stack(gate_up, so)
    with pytest.raises(ValueError, match="tile layout needs"):
        repack_tile_stack(gate_up[:, :16], torch.ones(EXPERTS, 16, 4, 2))  # groups of 64 columns
    assert torch.equal(gate_up, before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(QWEN3_MOE_TILES, tmp_path_factory.mktemp("moe_int4_tiles") / "float")


def _experts(model_dir: Path, ctx: ParallelContext) -> list[FusedMoE]:
    config = dataclasses.replace(ModelConfig.from_pretrained(model_dir), quantization="int4")
    model = load_model(model_dir, config, ctx, torch.float32)
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def _bytes(moes: list[FusedMoE]) -> int:
    return sum(p.numel() * p.element_size() for layer in moes for p in layer.parameters())


@needs_tiles
def test_loaded_expert_stacks_take_the_tile_layout_with_the_same_weights(model_dir: Path) -> None:
    tiles = _experts(model_dir, ParallelContext.single())
    torch.ops.tpserve_cpu.use_int4_tiles(False)
    try:
        row_major = _experts(model_dir, ParallelContext.single())
    finally:
        torch.ops.tpserve_cpu.use_int4_tiles(True)
    expert_parallel = _experts(model_dir, ParallelContext(1, 2, torch.device("cpu"), enable_expert_parallel=True))
    assert len(tiles) == len(row_major) == len(expert_parallel) == 2
    for tile, rows, ep in zip(tiles, row_major, expert_parallel, strict=True):
        assert tuple(tile.gate_up_proj.shape) == tuple(rows.gate_up_proj.shape) == (8, 256, 128)
        assert tuple(tile.gate_up_proj_scale.shape) == (8, 16, 2, 2, 16)
        assert tuple(rows.gate_up_proj_scale.shape) == (8, 256, 2, 2)
        assert tuple(tile.down_proj_scale.shape) == (8, 16, 1, 2, 16)
        assert tuple(rows.down_proj_scale.shape) == (8, 256, 1, 2)
        for name in ("gate_up_proj", "down_proj"):
            weights = dequantize_int4_experts(getattr(tile, name), getattr(tile, f"{name}_scale"), torch.float32)
            assert torch.equal(weights, dequantize_int4_experts(getattr(rows, name), getattr(rows, f"{name}_scale"),
                                                                torch.float32)), name
            assert torch.equal(getattr(ep, name), getattr(tile, name)[4:]), name  # whole experts 4-7
            assert torch.equal(getattr(ep, f"{name}_scale"), getattr(tile, f"{name}_scale")[4:]), name
    assert _bytes(tiles) == _bytes(row_major)  # same bytes: 4 bits a weight plus 64 / 128 of scale and offset


@needs_tiles
def test_the_shard_loaded_line_counts_the_weights_in_the_tile_layout(model_dir: Path) -> None:
    """``int4_tile_layout_layers`` (worker/server.py's ``shard loaded`` line): per layer qkv_proj (512 x 256), o_proj
    (256 x 256) and the two expert stacks, 8 in all at tp 1; none when the layout is switched off before loading."""
    def load() -> torch.nn.Module:
        config = dataclasses.replace(ModelConfig.from_pretrained(model_dir), quantization="int4")
        return load_model(model_dir, config, ParallelContext.single(), torch.float32)

    assert tile_layout_layers(load()) == 8
    torch.ops.tpserve_cpu.use_int4_tiles(False)
    try:
        assert tile_layout_layers(load()) == 0
    finally:
        torch.ops.tpserve_cpu.use_int4_tiles(True)


@pytest.fixture(scope="module")
def case(model_dir: Path) -> tuple[FamilyCase, tuple[Job, Job]]:
    reference = save_rtn_dequantized(model_dir, model_dir.parent / "dequantized", MOE_LINEAR_WEIGHT)
    case = dataclasses.replace(reference_case(QWEN3_MOE_TILES, reference, {0, 1}, 2), model_dir=str(model_dir))
    jobs = tuple(dataclasses.replace(job, name=f"tiles_{job.name.rsplit('_', 1)[-1]}", model_dir=str(model_dir),
                                     quantization="int4") for job in case.jobs)
    return case, jobs  # type: ignore[return-value]


@pytest.mark.parametrize("tp", [1, 2])
def test_tile_layout_experts_match_transformers_on_dequantized_weights(tp: int, case) -> None:
    """tp 1, and tp 2 expert-parallel (whole experts per rank, so both ranks repack theirs)."""
    family_case, jobs = case
    if tp == 2:
        jobs = tuple(dataclasses.replace(job, name=f"{job.name}_ep", enable_expert_parallel=True) for job in jobs)
    check_records(family_case, jobs, run_jobs(list(jobs), tp_size=tp), batch_bound=BATCH_BOUND)


def test_the_triton_experts_read_the_tile_layout(case, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's grouped kernel (Triton's interpreter here) on the same stacks: it widens them with
    :func:`dequantize_int4_experts`, which reads the tile layout; 3 prompts, 4 steps, tokens and logits as above."""
    monkeypatch.setattr(moe, "grouped_experts", grouped_experts_triton)
    family_case, _ = case
    job = dataclasses.replace(at_once_job(family_case, num_prompts=3, num_steps=4), name="tiles_triton",
                              quantization="int4")
    check_job(family_case, job, run_jobs([job], tp_size=1)[job.name])
