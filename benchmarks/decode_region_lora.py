"""Decode steps with LoRA adapter rows in the parallel region against the same stack's ops (``forward_lora``).

The 94.9M-parameter random Llama of benchmarks/peer_comparison.py, quantized at load (``--quantization``, int4 by
default), with two rank-16 adapters on every target (q, k, v, o, gate, up, down; the tests' writer,
tests/worker/lora_checkpoints.py) in a pool of 2 slots, tp 1, one process, the host's threads: the bare
``ModelRunner.execute`` of a decode step at 1, 4 and 8 sequences, each under one of the two adapters in turn, with
the compiled stack's step in the OpenMP parallel region (worker/kernels/cpu_decode_region.cpp, the default) and as
its ops with ``lora_add_`` after each projection (``use_decode_region(False)``), the two interleaved round by round;
the median of ``--rounds`` rounds, each the median of 20 steps after 4 unmeasured ones, from 32 positions of
context. The two paths are bit-identical (tests/worker/test_lora_decode_block.py); only time is measured here.

    python benchmarks/decode_region_lora.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.peer_comparison import build_model  # noqa: E402
from benchmarks.report import save_report  # noqa: E402
from tests.worker.lora_checkpoints import ALL_TARGETS, AdapterSpec, save_adapter  # noqa: E402
from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan  # noqa: E402
from worker.lora_settings import LoRASettings  # noqa: E402
from worker.model_runner import ModelRunner  # noqa: E402
from worker.parallel_state import ParallelContext  # noqa: E402

BATCHES = (1, 4, 8)
CONTEXT = 32
ADAPTERS = (AdapterSpec("all_r16_a", 16, 32.0, ALL_TARGETS, seed=1), AdapterSpec("all_r16_b", 16, 32.0, ALL_TARGETS, seed=2))


def step_ms(runner: ModelRunner, batch: int, first_id: int) -> float:
    """Median ms of 20 decode steps of ``batch`` sequences (sequence ``s`` under slot ``1 + s % 2``), after 4."""
    seqs = [first_id + s for s in range(batch)]
    new = tuple(NewSequence(seq, SamplingParams(temperature=0), lora_slot=1 + i % 2) for i, seq in enumerate(seqs))
    blocks_per_seq = (CONTEXT + 24) // 16 + 1
    prefill = tuple(ScheduledChunk(seq, tuple(range(3, 3 + CONTEXT)), 0,
                                   tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
                    for i, seq in enumerate(seqs))
    step_id = first_id * 100
    runner.execute(StepPlan(step_id, new, prefill))
    times = []
    for i in range(24):
        step_id += 1
        start = time.perf_counter()
        runner.execute(StepPlan(step_id, (), tuple(ScheduledChunk(seq, (5,), CONTEXT + i) for seq in seqs)))
        times.append(time.perf_counter() - start)
    runner.execute(StepPlan(step_id + 1, (), (), tuple(seqs)))  # the sequences leave: their blocks are reused
    return statistics.median(times[4:]) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="int4", help="--quantization of the base model (none: float32)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="directory for the report")
    args = parser.parse_args()
    ops = torch.ops.tpserve_cpu
    quantization = None if args.quantization == "none" else args.quantization
    with tempfile.TemporaryDirectory(prefix="tpserve-region-lora-") as tmp:
        model_dir = build_model(Path(tmp) / "float", args.seed)
        paths = []
        for spec in ADAPTERS:
            save_adapter(model_dir, spec, Path(tmp) / spec.name)
            paths.append(str(Path(tmp) / spec.name))
        settings = LoRASettings(max_loras=2, max_lora_rank=16, adapter_paths=tuple(paths))
        runner = ModelRunner(model_dir, ParallelContext.single(), torch.float32, 16, quantization=quantization,
                             lora=settings)
        runner.init_kv_cache(64)
        rounds: dict[str, dict[int, list[float]]] = {mode: {b: [] for b in BATCHES} for mode in ("region", "ops")}
        next_id = 1
        try:
            for i in range(args.rounds):
                for mode in ("region", "ops") if i % 2 == 0 else ("ops", "region"):
                    ops.use_decode_region(mode == "region")
                    for batch in BATCHES:
                        rounds[mode][batch].append(step_ms(runner, batch, next_id))
                        next_id += batch
        finally:
            ops.use_decode_region(True)
    median = {mode: {b: statistics.median(x) for b, x in per.items()} for mode, per in rounds.items()}
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
              "threads": torch.get_num_threads(), "quantization": args.quantization, "context": CONTEXT,
              "adapters": [spec.name for spec in ADAPTERS],
              "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "rounds_ms": {mode: {b: [round(x, 3) for x in xs] for b, xs in per.items()} for mode, per in rounds.items()},
              "step_ms": {mode: {b: round(t, 3) for b, t in per.items()} for mode, per in median.items()},
              "ops_over_region": {b: round(median["ops"][b] / median["region"][b], 3) for b in BATCHES}}
    for b in BATCHES:
        print(f"{b} adapter rows: region {median['region'][b]:.2f} ms, ops {median['ops'][b]:.2f} ms "
              f"({report['ops_over_region'][b]:.2f}x)")
    if args.out is not None:
        print("wrote", save_report(args.out, "decode_region_lora.json", report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
