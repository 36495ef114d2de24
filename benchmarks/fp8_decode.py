"""FP8 weights kept as e4m3 (``--quantization fp8``) against the same checkpoint dequantized at load (float32).

The 94.9M-parameter random Llama of benchmarks/peer_comparison.py, its decoder linear weights written as
an FP8 checkpoint with 128x128 block scales (``quant_method: fp8``, DeepSeek V3's layout; written by
tests/worker/lowbit_checkpoints.py), tp 1, one process:

* the bare worker step (``ModelRunner.execute`` of a decode step alone; the compiled decode stack where it
  applies) at batch 1 and 16 for ``float32`` (the checkpoint dequantized at load, the default) and ``fp8``
  (kept, worker/kernels/cpu_linear_fp8.cpp): the median of ``--rounds`` rounds, each the median of 20
  steps, the two interleaved round by round so that a busy host slows them alike;
* the projections alone: the 30 layers' four linear layers at one row of x, one thread, ``linear_fp8``
  against ``linear_f32`` (the float32 kernel the dequantized model runs), the median of ``5 * --rounds``
  interleaved rounds, in CPU seconds of the thread (``time.thread_time``).

Reported: each figure and float32 / fp8 (> 1: fp8 is faster), and the bytes per weight of the linear layers.

    python benchmarks/fp8_decode.py --out benchmarks/results      # the recorded run
    python benchmarks/fp8_decode.py --tiny                        # a quick check that it runs
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

from benchmarks.int4_decode import TINY_CONFIG  # noqa: E402
from benchmarks.peer_comparison import MODEL_CONFIG, bare_runner, bare_steps, build_model  # noqa: E402
from benchmarks.report import save_report  # noqa: E402
from tests.worker.lowbit_checkpoints import save_fp8_block  # noqa: E402  (the tests' FP8 writer)

CONFIGS = {"float32": None, "fp8": "fp8"}
BLOCK = (128, 128)
TINY_BLOCK = (32, 64)  # the tiny model's 64-row projections


def _linear_bytes_per_weight(model: torch.nn.Module) -> float:
    """Bytes of the decoder's linear layers (weights and scales) per weight."""
    params = dict(model.named_parameters())
    weights = [n for n in params if n.endswith("_proj.weight")]
    nbytes = sum(params[n].numel() * params[n].element_size() for n in params
                 if n.endswith(("_proj.weight", "_proj.weight_scale")))
    return nbytes / sum(params[n].numel() for n in weights)


def projections(shape: dict, rounds: int) -> dict[str, float]:
    """Seconds of the model's projections at one row of x, one thread: ``linear_fp8`` and ``linear_f32``."""
    from worker.kernels import cpu_kernels_available

    if not cpu_kernels_available():
        return {}
    ops = torch.ops.tpserve_cpu
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    dims = [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i)] * shape["num_hidden_layers"]
    w32 = [torch.randn(n, k) * 0.05 for n, k in dims]
    w8 = [(w.to(torch.float8_e4m3fn), torch.rand(w.shape[0], w.shape[1] // 128) + 0.5) for w in w32]
    xs = [torch.randn(1, k) for _, k in dims]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def fp8() -> None:
        for (w, s), x in zip(w8, xs, strict=True):
            ops.linear_fp8(x, w, s, None)

    def float32() -> None:
        for w, x in zip(w32, xs, strict=True):
            ops.linear_f32(x, w, None)

    times: dict[str, list[float]] = {}
    for _ in range(rounds * 5):
        for name, run in (("fp8", fp8), ("float32", float32)):
            start = time.thread_time()
            run()
            times.setdefault(name, []).append(time.thread_time() - start)
    torch.set_num_threads(threads)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="directory for quantization_fp8.json")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of the same family: checks the script")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--context", type=int, default=32, help="positions before the measured decode steps")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="the step's threads (default: every core, what a tp-1 rank takes; 1 on a host whose "
                             "cores other work shares, where a step's ~120 thread barriers each wait for a time slice)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: each step's CPU seconds on the calling thread (with --threads 1 on a shared "
                             "host: time spent waiting for a core left out)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    shape = TINY_CONFIG if args.tiny else MODEL_CONFIG
    block = TINY_BLOCK if args.tiny else BLOCK
    report: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}",
                    "load_average_at_start": os.getloadavg(), "torch": torch.__version__, "seed": args.seed,
                    "threads": args.threads, "clock": args.clock,
                    "model": {**shape, "checkpoint": f"fp8 e4m3, {block[0]}x{block[1]} block scales"},
                    "context": args.context, "rounds": args.rounds, "configs": {}}
    with tempfile.TemporaryDirectory(prefix="tpserve-fp8-") as tmp:
        float_dir = build_model(Path(tmp) / "float", args.seed, shape)
        fp8_dir, _ = save_fp8_block(float_dir, Path(tmp) / "fp8", Path(tmp) / "fp8_dequantized", block=block)
        runners = {name: bare_runner(fp8_dir, quantization=q) for name, q in CONFIGS.items()}
        rounds: dict[str, dict[int, list[float]]] = {name: {1: [], 16: []} for name in CONFIGS}
        for _ in range(args.rounds):
            for name, runner in runners.items():
                for batch, seconds in bare_steps(runner, [1, 16], context=args.context, clock=clock).items():
                    rounds[name][batch].append(seconds)
            print({n: {b: round(s[-1] * 1e3, 2) for b, s in d.items()} for n, d in rounds.items()}, flush=True)
        report["rounds_ms"] = {name: {b: [round(x * 1e3, 3) for x in s] for b, s in d.items()}
                               for name, d in rounds.items()}
        for name, runner in runners.items():
            median = {b: statistics.median(s) for b, s in rounds[name].items()}
            report["configs"][name] = {"bare_decode_ms_batch1": median[1] * 1e3,
                                       "bare_output_tokens_per_s_batch16": 16 / median[16],
                                       "linear_bytes_per_weight": _linear_bytes_per_weight(runner.model)}
    proj = projections(shape, args.rounds)
    report["projections_one_thread_ms"] = {name: seconds * 1e3 for name, seconds in proj.items()}
    fp8, f32 = report["configs"]["fp8"], report["configs"]["float32"]
    report["fp8_speedup_vs_float32"] = {
        "decode_batch1": f32["bare_decode_ms_batch1"] / fp8["bare_decode_ms_batch1"],
        "throughput_batch16": fp8["bare_output_tokens_per_s_batch16"] / f32["bare_output_tokens_per_s_batch16"]}
    if proj:
        report["fp8_speedup_vs_float32"]["projections"] = proj["float32"] / proj["fp8"]
    print(report["fp8_speedup_vs_float32"])
    if args.out:
        save_report(args.out, "quantization_fp8.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
