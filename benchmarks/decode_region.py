"""The decode step in one parallel region against the same stack's ops: the bare step, every CPU weight format.

On the 94.9M-parameter random Llama of benchmarks/peer_comparison.py (float32 checkpoint; int8 and int4
quantized at load; fp8: the same weights written as a block-scaled FP8 checkpoint, 128 x 128 blocks, by the
tests' writer, served with ``--quantization fp8``: e4m3 kept; w8: the same weights written as an 8-bit GPTQ
checkpoint, groups of 128 with zero points, by the tests' writer: group-wise 8-bit codes; int4_rowmajor: int4 loaded with
``use_int4_tiles(False)`` and run with ``use_amx_int4(False)``, what a CPU with AVX512-VNNI but no AMX-INT8
runs), tp 1, one process, one runner per format: the bare worker step (``ModelRunner.execute``
of a decode step alone, benchmarks/peer_comparison.py's ``bare_steps``) at batch 1, 8 and 16, with the
compiled stack's steps run in one OpenMP parallel region (worker/kernels/cpu_decode_region.cpp, the default)
and as its ten ops a layer (``torch.ops.tpserve_cpu.use_decode_region(False)``), the two interleaved round by
round so that a busy host slows them alike; the median of ``--rounds`` rounds, each the median of 20 steps.
The region takes float32, int8 and fp8 stacks where their ops take the streamed GEMV (up to 8 rows of x on
AVX-512: batch 1 and 8), w8 up to 64 rows (every batch here), int4 tile-layout stacks (AMX-INT8 CPUs) at every batch and the row-major int4 layout
up to 4 rows (batch 1); elsewhere both columns run the ops (a ratio of about 1, the noise of the run).

Reported: each figure, ops / region (> 1: the region is faster), and the int8 / int4 ratio each way.

    python benchmarks/decode_region.py --out benchmarks/results      # the recorded run
    python benchmarks/decode_region.py --tiny                        # a quick check that it runs
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.peer_comparison import MODEL_CONFIG, bare_runner, bare_steps, build_model  # noqa: E402
from benchmarks.report import save_report  # noqa: E402
from tests.worker.lowbit_checkpoints import save_fp8_block  # noqa: E402  (the tests' FP8 writer)
from tests.worker.w8a16_checkpoints import save_gptq8  # noqa: E402  (the tests' 8-bit GPTQ writer)

FORMATS = {"float32": None, "int8": "int8", "w8": None, "fp8": "fp8", "int4": "int4", "int4_rowmajor": "int4"}
W8_GROUP = 128
FP8_BLOCK = (128, 128)
BATCHES = [1, 8, 16]
TINY_CONFIG = {**MODEL_CONFIG, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="directory for the report")
    parser.add_argument("--name", default="decode_region.json", help="the report's file name")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of the same family: checks the script")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--context", type=int, default=32, help="positions before the measured decode steps")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the step's threads")
    args = parser.parse_args()
    if args.tiny and args.out:
        parser.error("--tiny only checks that the script runs: its figures are not the benchmark's; drop --out")
    from worker.kernels import cpu_kernels_available

    if not cpu_kernels_available():
        print("the compiled CPU kernels are not available here: nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    shape = TINY_CONFIG if args.tiny else MODEL_CONFIG
    ops = torch.ops.tpserve_cpu
    report: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}",
                    "load_average_at_start": os.getloadavg(), "torch": torch.__version__, "seed": args.seed,
                    "threads": args.threads, "model": {**shape, "checkpoint_dtype": "float32"},
                    "context": args.context, "rounds": args.rounds,
                    "int4_tile_layout": bool(ops.int4_tiles_enabled())}
    rounds: dict[str, dict[str, dict[int, list[float]]]] = {
        name: {mode: {b: [] for b in BATCHES} for mode in ("region", "ops")} for name in FORMATS}
    region_steps: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="tpserve-region-") as tmp:
        model_dir = build_model(Path(tmp) / "float", args.seed, shape)
        fp8_dir, _ = save_fp8_block(model_dir, Path(tmp) / "fp8", Path(tmp) / "fp8_dequantized", block=FP8_BLOCK)
        w8_dir, _ = save_gptq8(model_dir, Path(tmp) / "w8", Path(tmp) / "w8_dequantized", group=W8_GROUP, sym=False)
        checkpoints = {"fp8": fp8_dir, "w8": w8_dir}
        runners = {}
        for name, q in FORMATS.items():
            ops.use_int4_tiles(name != "int4_rowmajor")
            runners[name] = bare_runner(checkpoints.get(name, model_dir), quantization=q)
        ops.use_int4_tiles(True)
        try:
            for i in range(args.rounds):
                for name, runner in runners.items():
                    ops.use_amx_int4(name != "int4_rowmajor")
                    for mode in ("region", "ops") if i % 2 == 0 else ("ops", "region"):
                        ops.use_decode_region(mode == "region")
                        before = ops.decode_region_steps()
                        for batch, seconds in bare_steps(runner, BATCHES, context=args.context).items():
                            rounds[name][mode][batch].append(seconds)
                        if mode == "region":
                            region_steps[name] = region_steps.get(name, 0) + ops.decode_region_steps() - before
                print(f"round {i + 1}: ms a decode step at batch {BATCHES}, region / ops: " + "; ".join(
                    f"{n} " + ", ".join(f"{d['region'][b][-1] * 1e3:.2f}/{d['ops'][b][-1] * 1e3:.2f}" for b in BATCHES)
                    for n, d in rounds.items()), flush=True)
        finally:
            ops.use_decode_region(True)
            ops.use_amx_int4(True)
    median = {name: {mode: {b: statistics.median(s) for b, s in per.items()} for mode, per in d.items()}
              for name, d in rounds.items()}
    report["rounds_ms"] = {name: {mode: {b: [round(x * 1e3, 3) for x in s] for b, s in per.items()}
                                  for mode, per in d.items()} for name, d in rounds.items()}
    report["steps_in_region"] = region_steps
    report["bare_decode_ms"] = {name: {mode: {b: round(t * 1e3, 3) for b, t in per.items()} for mode, per in d.items()}
                                for name, d in median.items()}
    report["ops_over_region"] = {name: {b: round(d["ops"][b] / d["region"][b], 3) for b in BATCHES}
                                 for name, d in median.items()}
    report["int8_over_int4"] = {mode: {b: round(median["int8"][mode][b] / median["int4"][mode][b], 3)
                                       for b in BATCHES} for mode in ("region", "ops")}
    for name, d in median.items():
        print(f"{name}: bare step ms, region / ops: " + ", ".join(
            f"batch {b} {d['region'][b] * 1e3:.3f} / {d['ops'][b] * 1e3:.3f} ({d['ops'][b] / d['region'][b]:.2f}x)"
            for b in BATCHES))
    print("int8 / int4: " + "; ".join(f"{mode} " + ", ".join(f"batch {b} {r:.2f}x" for b, r in per.items())
                                      for mode, per in report["int8_over_int4"].items()))
    if args.out:
        print(f"wrote {save_report(args.out, args.name, report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
