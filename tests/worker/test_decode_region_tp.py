"""The CPU decode region on tensor-parallel ranks equals the layers' halves around ``ctx.all_reduce`` bit for bit.

At tp > 1 on one host, with the compiled shared-memory collectives, a decode step runs every layer in one
OpenMP parallel region whose thread 0 sums o's and the MLP's partial products over the ranks
(worker/kernels/cpu_decode_region.cpp, ``tpserve::shm_all_reduce``) and adds the row-parallel bias after the
sum; where the region does not take a step, the ranks run each layer as ``attention_block``, the all-reduce,
``mlp_block``, the all-reduce (worker/layers/decode_block.py). Each checkpoint runs the same plans twice in one
process group, the region on and off (``use_decode_region(False)``: the halves), and every sampled row's
logits and token must be equal, not close: the same kernels in the same order, the same sums in rank order.

The plans: a prefill of three prompts (the module path in both runs), decodes of all three at growing contexts
(past a sliding window where the model has one), a 3-token prompt that joins the decode rows, a finished
sequence that leaves them, six 2-token prompts that join three decodes (15 rows) and a decode step of 9
sequences (those two: more rows than the float32 and 8-bit GEMVs' decode path, so the halves in both runs;
int4 tiles take any). The checkpoints cover o_proj and MLP biases (added once, after the sum), q/k/v biases,
GQA and MQA, a window, QK-norm, float16 projections kept 16-bit, weight-only int8, group-wise 8-bit (8-bit GPTQ),
int4 tiles (AMX-INT8 and AVX512-VNNI CPUs; the row-major VNNI path with use_int4_tiles(False)) and 8-bit KV caches; the degrees
2 and 4 (1 KV head per rank at 4), and LoRA adapter rows (three adapters and the base model, on the biased
model: the adapters' sums before the all-reduce and the bias). And a peer lost inside the region fails the step,
as a lost peer fails ``SharedMemoryComm``'s collective.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model
from tests.worker.lora_checkpoints import ALL_TARGETS, AdapterSpec, save_adapter
from tests.worker.region_specs import INT4_TILES, MISTRAL_WINDOW_INT4_TILES, int4_vnni
from tests.worker.tp_harness import Job, run_jobs
from tests.worker.int8_checkpoints import save_cast
from tests.worker.w8a16_checkpoints import save_gptq8
from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
from worker.kernels import _cpu_supports_avx2, cpu_kernels_available
from worker.lora_settings import LoRASettings

pytestmark = pytest.mark.skipif(not (_cpu_supports_avx2() and shutil.which("c++")),
                                reason="the decode region is a compiled kernel: needs an AVX2 CPU and a C++ compiler")

BLOCK_SIZE = 4
BLOCKS_PER_SEQ = 16
GREEDY = SamplingParams(temperature=0.0)


def _plans(lora: bool = False) -> tuple[StepPlan, ...]:
    """The module docstring's plans; ``lora``: sequence ``s`` under adapter slot ``s % 4`` (0: the base model)."""
    prompts = {0: list(range(3, 8)), 1: list(range(20, 31)), 2: list(range(40, 60)), 3: [9, 8, 7]}
    for seq in range(4, 10):
        prompts[seq] = [11 + seq, 12 + seq]
    blocks = {seq: tuple(range(BLOCKS_PER_SEQ * seq, BLOCKS_PER_SEQ * (seq + 1))) for seq in prompts}
    positions: dict[int, int] = {}
    plans: list[StepPlan] = []

    def step(new: tuple[int, ...], decodes: tuple[int, ...], finished: tuple[int, ...] = ()) -> None:
        chunks = [ScheduledChunk(s, (5 + s,), positions[s]) for s in decodes]
        chunks += [ScheduledChunk(s, tuple(prompts[s]), 0, blocks[s]) for s in new]
        for chunk in chunks:
            positions[chunk.seq_id] = chunk.start_position + len(chunk.token_ids)
        plans.append(StepPlan(len(plans) + 1, tuple(NewSequence(s, GREEDY, lora_slot=s % 4 if lora else 0)
                                                     for s in new), tuple(chunks), finished))

    step((0, 1, 2), ())
    for _ in range(10):
        step((), (0, 1, 2))
    step((3,), (0, 1, 2))
    for _ in range(4):
        step((), (0, 1, 2, 3))
    step((), (0, 2, 3), finished=(1,))
    for _ in range(3):
        step((), (0, 2, 3))
    step(tuple(range(4, 10)), (0, 2, 3))
    step((), (0, 2, 3, *range(4, 10)))  # 9 rows
    step((), (0, 2, 3))
    return tuple(plans)


def _case_checkpoint(name: str, tiny_checkpoints: dict[str, Path], tmp_path: Path) -> Path:
    specs = {spec.name: spec for spec in (INT4_TILES, MISTRAL_WINDOW_INT4_TILES)}
    if name == "gqa_tied_gptq8":  # 8-bit GPTQ with zero points, group 32: group-wise 8-bit codes (the w8 op)
        return save_gptq8(tiny_checkpoints["gqa_tied"], tmp_path / "gptq8", tmp_path / "gptq8_dq", group=32,
                          sym=False)[0]
    if name == "mqa_untied_bias_fp16":  # float16 projections kept 16-bit (worker/layers_w16.py): linear_w16's GEMV
        return save_cast(tiny_checkpoints["mqa_untied_bias"], tmp_path / "fp16", torch.float16)
    return save_tiny_model(specs[name], tmp_path / name) if name in specs else tiny_checkpoints[name]


ADAPTERS = (
    AdapterSpec("all_r4", 4, 8.0, ALL_TARGETS, seed=31),
    AdapterSpec("qv_down_r8_rslora", 8, 16.0, ("q_proj", "v_proj", "down_proj"), use_rslora=True, seed=32),
    AdapterSpec("k_o_mlp_r2", 2, 4.0, ("k_proj", "o_proj", "gate_proj", "up_proj"), seed=33),
)


def _lora_settings(checkpoint: Path, tmp_path: Path) -> LoRASettings:
    """Three adapters of ``checkpoint`` (every target; q, v, down with rsLoRA; k, o and the MLP) in 4 slots."""
    paths = []
    for adapter in ADAPTERS:
        save_adapter(checkpoint, adapter, tmp_path / f"{checkpoint.name}-{adapter.name}")
        paths.append(str(tmp_path / f"{checkpoint.name}-{adapter.name}"))
    return LoRASettings(max_loras=4, max_lora_rank=8, adapter_paths=tuple(paths))


CASES = {  # name -> (checkpoint, --quantization, --kv-cache-dtype)
    "gqa_tied": ("gqa_tied", None, "auto"),
    "mqa_untied_bias": ("mqa_untied_bias", None, "auto"),
    "mqa_untied_bias_lora": ("mqa_untied_bias", None, "auto"),  # three adapters and the base model
    "mqa_untied_bias_fp16": ("mqa_untied_bias_fp16", None, "auto"),
    "qwen2_qkv_bias_int8": ("qwen2_qkv_bias", "int8", "auto"),
    "gqa_tied_gptq8": ("gqa_tied_gptq8", None, "auto"),
    "qwen3_qk_norm_fp8_cache": ("qwen3_qk_norm", "int8", "fp8"),
    "int4_tiles": (INT4_TILES.name, "int4", "auto"),
    "mistral_window_int4_int8_cache": (MISTRAL_WINDOW_INT4_TILES.name, "int4", "int8"),
}
DEGREES = {2: tuple(CASES), 4: ("gqa_tied", "mqa_untied_bias", "mqa_untied_bias_lora")}


@pytest.mark.parametrize("tp", sorted(DEGREES))
def test_the_region_equals_the_halves_on_tensor_parallel_ranks(tp: int, tiny_checkpoints: dict[str, Path],
                                                                tmp_path: Path) -> None:
    jobs = []
    for case in DEGREES[tp]:
        checkpoint, quantization, kv_cache_dtype = CASES[case]
        model_dir = _case_checkpoint(checkpoint, tiny_checkpoints, tmp_path)
        lora = _lora_settings(model_dir, tmp_path) if case.endswith("_lora") else None
        for region in (True, False):
            jobs.append(Job(f"{case}/{region}", str(model_dir), _plans(lora is not None),
                            num_blocks=BLOCKS_PER_SEQ * 10, block_size=BLOCK_SIZE, quantization=quantization,
                            kv_cache_dtype=kv_cache_dtype, decode_region=region, lora=lora))
    records = run_jobs(jobs, tp)
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    int4_tiles = cpu_kernels_available() and bool(torch.ops.tpserve_cpu.int4_tiles_enabled())
    vnni = cpu_kernels_available() and int4_vnni()
    for case in DEGREES[tp]:
        quantization = CASES[case][1]
        on, off = records[f"{case}/True"], records[f"{case}/False"]
        assert sum(r.decode_region_steps for r in off) == 0
        # Every step but the first (its prompts are prefill chunks) takes the decode block: short prompts join the
        # decode rows. The region's formats: float32 and int8 where their GEMV takes its AVX-512 decode path (up
        # to 8 rows), int4 in the tile layout at any row count (AVX512-VNNI alone: up to 16), or (no tiles) the row-major layout's AVX512-VNNI
        # path up to 4 rows.
        rows = [sum(chunk.num_tokens for chunk in plan.scheduled) for plan in _plans()[1:]]
        if quantization == "int4":
            expected = (sum(bool(torch.ops.tpserve_cpu.int4_tiles_take_rows(n)) for n in rows) if int4_tiles
                        else (sum(n <= 4 for n in rows) if vnni else 0))
        elif case == "gqa_tied_gptq8":  # group-wise 8-bit: up to 64 rows
            expected = len(rows) if avx512 else 0
        else:
            expected = sum(n <= 8 for n in rows) if avx512 else 0
        assert sum(r.decode_region_steps for r in on) == expected, case
        for i, (a, b) in enumerate(zip(on, off, strict=True)):
            assert a.sampled_token_ids == b.sampled_token_ids, (case, i)
            assert (a.logits is None) == (b.logits is None)
            if a.logits is not None:
                assert torch.equal(a.logits, b.logits), \
                    f"{case} step {i}: max difference {(a.logits - b.logits).abs().max().item():.3g}"


def _lost_peer_main(rank: int, model_dir: str, mode: str, timeout_s: float, init_method: str, out_path: str) -> None:
    """Two ranks run the plans' first three steps; at the fourth, rank 1 leaves inside its decode stack (``exited``:
    the process ends; ``hung``: it waits, alive, until rank 0 has its outcome), after the embedding's all-reduce,
    so that rank 0 meets the loss in the region's first collective. Rank 0 records how its step ends."""
    import os
    import pickle
    import time

    import worker.layers.decode_block as decode_block
    from tests.worker.tp_harness import share_cores
    from worker.model_runner import ModelRunner
    from worker.parallel_state import init_distributed

    share_cores()
    ctx = init_distributed(rank, 2, init_method, "cpu", timeout_s)
    runner = ModelRunner(model_dir, ctx, torch.float32, BLOCK_SIZE)
    runner.init_kv_cache(BLOCKS_PER_SEQ * 4)
    plans = _plans()
    for plan in plans[:3]:
        runner.execute(plan)
    if rank == 1:
        def leave(*args: object) -> None:
            if mode == "hung":
                deadline = time.monotonic() + timeout_s + 5.0
                while not os.path.exists(out_path) and time.monotonic() < deadline:
                    time.sleep(0.05)
            os._exit(0)
        decode_block.DecodeStack.__call__ = leave  # type: ignore[method-assign, assignment]
        runner.execute(plans[3])
        os._exit(1)  # not reached
    region_steps = torch.ops.tpserve_cpu.decode_region_steps()
    assert ctx.shm is not None and ctx.shm.compiled
    region_collective = ctx.shm.next_collective + 1  # after the embedding's all-reduce
    start = time.monotonic()
    try:
        runner.execute(plans[3])
        outcome = "returned"
    except Exception as error:  # noqa: BLE001 - the outcome is what the test checks
        outcome = f"{type(error).__name__}: {error}"
    seconds = time.monotonic() - start
    with open(out_path + ".tmp", "wb") as f:
        pickle.dump((outcome, seconds, torch.ops.tpserve_cpu.decode_region_steps() - region_steps,
                     region_collective), f)
    os.rename(out_path + ".tmp", out_path)
    os._exit(0)  # skip destroy_process_group, which would wait for the lost peer


@pytest.mark.skipif(not (cpu_kernels_available() and torch.backends.cpu.get_cpu_capability() == "AVX512"),
                    reason="the float32 region is the streamed GEMV of an AVX-512 CPU")
@pytest.mark.parametrize("mode", ["exited", "hung"])
def test_a_lost_peer_fails_the_region_step_instead_of_hanging_it(mode: str, tiny_checkpoints: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    """The region's collective checks its peers as ``SharedMemoryComm`` does: an exited peer fails the step within
    its sleeps (20 ms each), a hung one after the group's timeout, with the same RuntimeError, never a hang."""
    import pickle

    from tests.worker.rank_processes import spawn_ranks
    from tests.worker.tp_harness import _free_port

    timeout_s = 2.0
    out_path = str(tmp_path / "rank0.pkl")
    spawn_ranks(_lost_peer_main, (str(tiny_checkpoints["gqa_tied"]), mode, timeout_s,
                                  f"tcp://127.0.0.1:{_free_port()}", out_path), nprocs=2)
    with open(out_path, "rb") as f:
        outcome, seconds, region_steps, seq = pickle.load(f)
    assert region_steps == 1  # rank 0's step entered the region, where its first collective met the loss
    if mode == "exited":
        assert outcome == f"RuntimeError: ranks [1] exited during shared-memory collective {seq} (rank 0)", outcome
        assert seconds < timeout_s
    else:
        assert outcome.startswith(f"RuntimeError: Timed out after {timeout_s:.1f} s waiting for ranks [1] in "
                                  f"shared-memory collective {seq} (rank 0)"), outcome
        assert timeout_s <= seconds < timeout_s * 5
