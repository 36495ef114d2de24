"""How fast a decode step's linears stream the 95M benchmark model's weights, per vector path
(docs/design/kernels.md, "Compiled CPU kernels").

All 30 layers' four projections of benchmarks/peer_comparison.py's model (QKV 1024 x 512, O 512 x 512,
gate-up 3072 x 512, down 512 x 1536; float32, 377 MB, more than any cache) multiplied by ``M`` rows:
tpserve's compiled kernel on its AVX-512 and AVX2 paths (worker/kernels/cpu_linear.cpp, switched
with ``use_avx512``), MKL's ``F.linear``, and the read-only bound: ``torch.sum`` over the same bytes.
Interleaved repetitions (the machine's bandwidth drifts); each system's best and median, in ms and
GB/s of weights read. llama.cpp's rate for comparison: weight bytes / its decode ms per token in
peer_comparison.py's report.

    python benchmarks/decode_linears.py [--rows 1 4 16] [--threads 2] [--reps 15]   # ~1 minute
    python benchmarks/decode_linears.py --threads 1 --cpu-time   # on a busy machine
    python benchmarks/decode_linears.py --int8   # weight-only int8 (linear_int8), 95 MB
    python benchmarks/decode_linears.py --rows 1 2 4 --baseline-repo ../old --out benchmarks/results --name X.json

``--baseline-repo``: another checkout's ``worker/kernels/cpu_linear.cpp``, compiled here under its own
op namespace (``tpserve_cpu_baseline``) and timed in the same interleaved reps on each vector path,
so a kernel change is measured against its parent in one run.

``--cpu-time`` (one thread only): the calling thread's CPU time instead of wall time, so time
spent descheduled by other processes does not count (memory stalls still do). On a shared host
at load average 10-20 it separated variants whose wall times were noise.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.report import save_report  # noqa: E402
from worker.kernels import _FLAGS, cpu_kernels_available  # noqa: E402

SHAPES = [(1024, 512), (512, 512), (3072, 512), (512, 1536)]  # (N, K) of one layer's projections
LAYERS = 30


def load_baseline(repo: Path):
    """``repo``'s linear kernel as ``torch.ops.tpserve_cpu_baseline`` (compiled in a temporary directory)."""
    from torch.utils import cpp_extension

    kernels = repo / "worker" / "kernels"
    build = Path(tempfile.mkdtemp(prefix="tpserve-baseline-kernel-"))
    source = (kernels / "cpu_linear.cpp").read_text().replace("tpserve_cpu", "tpserve_cpu_baseline")
    (build / "cpu_linear.cpp").write_text(source)
    for header in kernels.glob("*.h"):
        (build / header.name).write_text(header.read_text())
    cpp_extension.load(name="tpserve_cpu_baseline", sources=[str(build / "cpu_linear.cpp")], extra_cflags=_FLAGS,
                       extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False)
    return torch.ops.tpserve_cpu_baseline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--cpu-time", action="store_true", help="time with the thread's CPU time (--threads 1)")
    parser.add_argument("--baseline-repo", type=Path, default=None,
                        help="a checkout whose cpu_linear.cpp is timed beside this one's, in the same reps")
    parser.add_argument("--int8", action="store_true",
                        help="weight-only int8 weights (per-row scales, linear_int8) instead of float32")
    parser.add_argument("--out", type=Path, default=None, help="directory for the JSON report")
    parser.add_argument("--name", default="decode_linears.json", help="the report's file name in --out")
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time counts the calling thread only: use --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    if not cpu_kernels_available():
        print("the compiled kernels are not available on this machine")
        return 1
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) for _ in range(LAYERS) for n, k in SHAPES]
    if args.int8:  # symmetric per-row int8, as worker/layers/quantization.py stores it
        scales = [w.abs().amax(dim=1) / 127 for w in weights]
        weights = [torch.round(w / s[:, None]).to(torch.int8) for w, s in zip(weights, scales)]
    # The read-only bound reads the weights' bytes as float32 (int8 values reinterpreted: the sum is noise).
    flat = torch.cat([w.flatten() for w in weights]).view(torch.float32)
    nbytes = flat.numel() * 4
    ops = torch.ops.tpserve_cpu
    paths = ["avx512", "avx2"] if ops.use_avx512(True) else ["avx2"]
    baseline = load_baseline(args.baseline_repo) if args.baseline_repo else None
    report: dict = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
                    "torch": torch.__version__, "weight_bytes": nbytes, "reps": args.reps,
                    "weights": "int8" if args.int8 else "float32",
                    "clock": "thread_time" if args.cpu_time else "perf_counter",
                    "baseline_repo": str(args.baseline_repo) if args.baseline_repo else None, "rows": {}}
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g) for _, k in SHAPES}

        def run(lib, path: str) -> None:
            lib.use_avx512(path == "avx512")
            if args.int8:
                for w, s in zip(weights, scales):
                    lib.linear_int8(xs[w.shape[1]], w, s, None)
            else:
                for w in weights:
                    lib.linear_f32(xs[w.shape[1]], w, None)

        def kernel(path: str) -> None:
            run(ops, path)

        def mkl() -> None:
            for w in weights:
                F.linear(xs[w.shape[1]], w if not args.int8 else w.float())

        def baseline_kernel(path: str) -> None:
            run(baseline, path)

        systems = {f"kernel {p}": (lambda p=p: kernel(p)) for p in paths}
        if baseline is not None:
            systems |= {f"baseline kernel {p}": (lambda p=p: baseline_kernel(p)) for p in paths}
        if not args.int8:  # (MKL has no int8-weight GEMM)
            systems["MKL F.linear"] = mkl
        systems["read-only bound (sum)"] = lambda: flat.sum()
        times: dict[str, list[float]] = {name: [] for name in systems}
        for _ in range(args.reps):
            for name, fn in systems.items():
                start = clock()
                fn()
                times[name].append(clock() - start)
        ops.use_avx512(True)
        print(f"M = {m}, {args.threads} threads, {nbytes / 1e6:.0f} MB of {'int8' if args.int8 else 'float32'} weights,"
              f" {args.reps} interleaved reps"
              f"{', thread CPU time' if args.cpu_time else ''}:")
        row: dict = {}
        for name, ts in times.items():
            best, median = min(ts), statistics.median(ts)
            row[name] = {"best_ms": best * 1e3, "median_ms": median * 1e3}
            print(f"  {name:24s} best {best * 1e3:7.2f} ms ({nbytes / best / 1e9:5.1f} GB/s)"
                  f"  median {median * 1e3:7.2f} ms ({nbytes / median / 1e9:5.1f} GB/s)")
        bound = statistics.median(times["read-only bound (sum)"])
        ratios = {f"{name} / read-only bound": statistics.median(ts) / bound for name, ts in times.items()
                  if name.startswith(("kernel", "baseline"))}
        if baseline is not None:
            ratios |= {f"kernel {p} / baseline {p}": (statistics.median(times[f"kernel {p}"])
                                                      / statistics.median(times[f"baseline kernel {p}"]))
                       for p in paths}
        for name, ratio in ratios.items():
            print(f"  {name:40s} {ratio:.3f} (medians)")
        report["rows"][str(m)] = {"systems": row, "ratios": ratios}
    if args.out:
        save_report(args.out, args.name, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
