"""Weight-only int4 against int8 (and float32): decode speed on the 95M shape, in one run, ratios included.

On the 94.9M-parameter random Llama of benchmarks/peer_comparison.py (float32 checkpoint, quantized
at load by ``--quantization int4`` / ``int8``), tp 1, one process:

* the bare worker step (``ModelRunner.execute`` of a decode step alone; the compiled decode stack
  where it applies): seconds at batch 1 and 16, the median of ``--rounds`` rounds, each round
  the median of 20 steps (after 4 unmeasured ones), the configurations interleaved round by round so
  that a busy host slows them alike. ``int4`` takes the kernel's best path (on an AMX-INT8 or
  AVX512-VNNI CPU the tile layout the weights are repacked into at load:
  worker/kernels/cpu_linear_int4_tiles.cpp), ``int4_rowmajor`` the same weights loaded with
  ``use_int4_tiles(False)``: the row-major layout and its paths (on AMX: AVX512-VNNI at one row, the
  row-major AMX path from two; without: VNNI at 1-4 rows, the float path at 5-8, the dequantized rows'
  tiles from 9: the kernels before the tile layout);
* the projections alone: the 30 layers' four linear layers at one row of x, on one thread, through
  ``linear_int4`` (the tile layout, the row-major layout's default path and its float path),
  ``linear_int8`` and ``linear_f32``, the median of ``5 * --rounds`` interleaved rounds, in CPU seconds
  of the thread (``time.thread_time``), each timed pass after one untimed pass over the same weights
  (a decode step reads the weights the previous step read: warm in the last-level cache as far as
  they fit, as in serving, not evicted by the other configurations' weights).

Reported: each figure, and int8 / int4 and float32 / int4 (> 1: int4 is faster). The weights'
bytes per parameter of the linear layers are reported too (int4: 4.5 bits at groups of 128).

    python benchmarks/int4_decode.py --out benchmarks/results      # the recorded run
    python benchmarks/int4_decode.py --tiny                        # a quick check that it runs
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import statistics
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.peer_comparison import MODEL_CONFIG, bare_runner, bare_steps, build_model  # noqa: E402
from benchmarks.report import save_report  # noqa: E402
from worker.layers.int4_matmul import tile_layout_layers  # noqa: E402

CONFIGS = {"float32": None, "int8": "int8", "int4": "int4", "int4_rowmajor": "int4"}
TINY_CONFIG = {**MODEL_CONFIG, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2}


def _linear_bytes_per_weight(model: torch.nn.Module) -> float:
    """Bytes of the decoder's linear layers (weights and scales) per weight."""
    params = dict(model.named_parameters())
    weights = [n for n in params if n.endswith("_proj.weight")]
    nbytes = sum(params[n].numel() * params[n].element_size() for n in params
                 if n.endswith(("_proj.weight", "_proj.weight_scale")))
    elements = sum(params[n].numel() * (2 if params[n].dtype == torch.uint8 else 1) for n in weights)
    return nbytes / elements


def projections(shape: dict, rounds: int) -> dict[str, float]:
    """Seconds of the model's projections at one row of x, one thread, each layout and type (module docstring)."""
    from worker.kernels import cpu_kernels_available
    from worker.layers.int4_matmul import pack_codes, pack_tiles, tile_layout_applies

    if not cpu_kernels_available():
        return {}
    ops = torch.ops.tpserve_cpu
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    dims = [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i)] * shape["num_hidden_layers"]
    w4 = [(pack_codes(torch.randint(0, 16, (n, k))), torch.rand(n, k // 128, 2), torch.randn(1, k)) for n, k in dims]
    w4t = [(*pack_tiles(w, s), x) if tile_layout_applies(w, s) else (w, s, x) for w, s, x in w4]
    w8 = [(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n), torch.randn(1, k)) for n, k in dims]
    w32 = [(torch.randn(n, k), torch.randn(1, k)) for n, k in dims]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def int4() -> None:
        for w, s, x in w4t:
            ops.linear_int4(x, w, s, None)

    def int4_rowmajor() -> None:
        for w, s, x in w4:
            ops.linear_int4(x, w, s, None)

    def int4_float_path() -> None:
        ops.use_vnni_int4(False)
        try:
            with _amx_off():
                int4_rowmajor()
        finally:
            ops.use_vnni_int4(True)

    def int8() -> None:
        for w, s, x in w8:
            ops.linear_int8(x, w, s, None)

    def float32() -> None:
        for w, x in w32:
            ops.linear_f32(x, w, None)

    times: dict[str, list[float]] = {}
    for _ in range(rounds * 5):
        for name, run in (("int4", int4), ("int4_rowmajor", int4_rowmajor), ("int4_float_path", int4_float_path),
                          ("int8", int8), ("float32", float32)):
            for _ in range(3):  # the weights warm, as a decode step finds them after the previous ones
                run()
            start = time.thread_time()
            run()
            times.setdefault(name, []).append(time.thread_time() - start)
    torch.set_num_threads(threads)
    return {name: statistics.median(t) for name, t in times.items()}


@contextlib.contextmanager
def _amx_off():
    """The row-major int4 kernel without its AMX path (its VNNI path where the CPU has one)."""
    from worker.kernels import cpu_kernels_available

    if not cpu_kernels_available():
        yield
        return
    torch.ops.tpserve_cpu.use_amx_int4(False)
    try:
        yield
    finally:
        torch.ops.tpserve_cpu.use_amx_int4(True)


@contextlib.contextmanager
def _tiles_off():
    """Layers loaded inside keep the row-major int4 layout (``use_int4_tiles(False)``): the kernel before it."""
    from worker.kernels import cpu_kernels_available

    if not cpu_kernels_available():
        yield
        return
    torch.ops.tpserve_cpu.use_int4_tiles(False)
    try:
        yield
    finally:
        torch.ops.tpserve_cpu.use_int4_tiles(True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="directory for the report")
    parser.add_argument("--name", default="quantization_int4.json", help="the report's file name")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of the same family: checks the script")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--context", type=int, default=32, help="positions before the measured decode steps")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="the step's threads (default: every core, what a tp-1 rank takes; 1 on a host whose "
                             "cores other work shares, where a step's ~120 thread barriers each wait for a time slice)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: each step's CPU seconds on the calling thread (with --threads 1 on a shared "
                             "host: time spent waiting for a core left out)")
    args = parser.parse_args()
    if args.tiny and args.out:
        parser.error("--tiny only checks that the script runs (a 2-layer model): its figures are not the "
                     "benchmark's, so it writes no report; drop --out")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    shape = TINY_CONFIG if args.tiny else MODEL_CONFIG
    report: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}",
                    "load_average_at_start": os.getloadavg(), "torch": torch.__version__, "seed": args.seed,
                    "threads": args.threads, "clock": args.clock,
                    "model": {**shape, "checkpoint_dtype": "float32"}, "context": args.context,
                    "rounds": args.rounds, "configs": {}}
    with tempfile.TemporaryDirectory(prefix="tpserve-int4-") as tmp:
        model_dir = build_model(Path(tmp), args.seed, shape)
        runners = {}
        for name, q in CONFIGS.items():
            with _tiles_off() if name == "int4_rowmajor" else contextlib.nullcontext():
                runners[name] = bare_runner(model_dir, quantization=q)
        rounds: dict[str, dict[int, list[float]]] = {name: {1: [], 16: []} for name in CONFIGS}
        for i in range(args.rounds):
            for name, runner in runners.items():
                for batch, seconds in bare_steps(runner, [1, 16], context=args.context, clock=clock).items():
                    rounds[name][batch].append(seconds)
            print(f"round {i + 1}: ms a decode step at batch 1 / 16: "
                  + ", ".join(f"{n} {d[1][-1] * 1e3:.2f} / {d[16][-1] * 1e3:.2f}" for n, d in rounds.items()),
                  flush=True)
        best = {name: {b: statistics.median(s) for b, s in d.items()} for name, d in rounds.items()}
        report["rounds_ms"] = {name: {b: [round(x * 1e3, 3) for x in s] for b, s in d.items()}
                               for name, d in rounds.items()}
        for name, runner in runners.items():
            report["configs"][name] = {"bare_decode_ms_batch1": best[name][1] * 1e3,
                                       "bare_output_tokens_per_s_batch16": 16 / best[name][16],
                                       "linear_bytes_per_weight": _linear_bytes_per_weight(runner.model),
                                       "int4_tile_layout_layers": tile_layout_layers(runner.model)}
    proj = projections(shape, args.rounds)
    report["projections_one_thread_ms"] = {name: seconds * 1e3 for name, seconds in proj.items()}
    int4 = report["configs"]["int4"]
    report["int4_speedup"] = {
        base: {"decode_batch1": report["configs"][base]["bare_decode_ms_batch1"] / int4["bare_decode_ms_batch1"],
               "throughput_batch16": int4["bare_output_tokens_per_s_batch16"]
               / report["configs"][base]["bare_output_tokens_per_s_batch16"]}
        for base in ("int8", "float32", "int4_rowmajor")}
    if proj:
        for base in ("int8", "float32", "int4_rowmajor", "int4_float_path"):
            report["int4_speedup"][f"projections_vs_{base}"] = proj[base] / proj["int4"]
    for key, value in report["int4_speedup"].items():  # what each figure is, in words (the report has them all)
        if isinstance(value, dict):  # a configuration: its decode-step ratios
            print(f"int4 against {key}: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}x" for k, v in value.items()))
        else:  # projections_vs_<path>: the 30 layers' projections at one row, one thread
            print(f"int4 {key.replace('_', ' ')} (one row, one thread): {value:.2f}x")
    if args.out:
        save_report(args.out, args.name, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
