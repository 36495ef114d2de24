"""tpserve's 4- and 8-bit weights against llama.cpp's Q4_0 and Q8_0 files (or tpserve's alone), in one run.

The 94.9M-parameter random Llama of benchmarks/peer_comparison.py (float32, seed 0): tpserve
serves it with ``--quantization int4`` (RTN, groups of 128: 4.5 bits a weight) and
``--quantization int8`` (per output channel), one rank (tp 1, the rank's threads by the
server's own rule: every core); llama.cpp's ``llama-server`` serves the same model converted
to GGUF by benchmarks/llama_cpp/build.sh and quantized by its ``llama-quantize`` to Q4_0
(blocks of 32: 4.5 bits a weight) and Q8_0 (blocks of 32: 8.5 bits), 2 threads, 16 slots. tpserve
holds the LM head int8 per row (worker/lm_head_int8.py) and the untied embedding float32;
``llama-quantize`` picks its own types for them (Q4_0's output tensor is Q6_K by its default).
``--shape vocab32k``: benchmarks/lm_head_int8.py's 0.16B model with a 32,000-token vocabulary
instead (its head a fifth of the parameters; the GGUF from ``VOCAB32K=1 bash benchmarks/llama_cpp/build.sh``).

Every system gets the same requests (peer_comparison's workloads: token ids, greedy,
``ignore_eos``): ``single`` (32 prompt tokens, 128 out: the client's decode ms/token),
``batch16`` (16 x 128 in / 128 out: output tokens/s) and ``mixed`` (48 requests of 16-256 in,
16-192 out: output tokens/s). The four servers stay up for the whole run; each of ``--rounds``
rounds runs ``single`` and ``batch16`` on every system back to back (the order rotates each
round), each goal's ratio is taken within a round and the median over rounds reported, so a
host whose speed drifts slows both sides of a ratio alike. ``mixed`` runs once per system at
the end.

Goals (issue 49): tpserve int4 >= 1.3x llama.cpp Q4_0's decode speed at one request, >= 1.5x
its tokens/s at 16 at once and on ``mixed``; tpserve int4 >= 1.5x tpserve int8 at one request.
Without the three ``--llama-*`` paths (a host where llama.cpp is not built: its build takes 25-60
minutes on 2 cores) only tpserve's two servers run, and only the goal between them is reported.

    python benchmarks/quantized_peer_comparison.py \\
        --llama-server ~/.cache/tpserve/llama_cpp/build/bin/llama-server \\
        --llama-quantize ~/.cache/tpserve/llama_cpp/build/bin/llama-quantize \\
        --llama-gguf ~/.cache/tpserve/llama_cpp/m95-f32.gguf --out benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.llama_cpp.server import LlamaServer  # noqa: E402
from benchmarks.lm_head_int8 import build_real_vocab_model  # noqa: E402
from benchmarks.peer_comparison import (  # noqa: E402
    _load, build_model, interleaved_round, machine_description, workloads)
from benchmarks.report import save_report  # noqa: E402
from tests.e2e.cluster import serve  # noqa: E402

#: (what, numerator system, denominator system, figure, comparison, goal). Speed ratios: > 1 means
#: the numerator is faster (for ms/token the denominator's time over the numerator's).
GOALS = [
    ("int4 / llama.cpp Q4_0 decode speed, 1 request", "int4", "Q4_0", "single", ">=", 1.3),
    ("int4 / llama.cpp Q4_0 tok/s, 16 at once", "int4", "Q4_0", "batch16", ">=", 1.5),
    ("int4 / int8 decode speed, 1 request", "int4", "int8", "single", ">=", 1.5),
    ("int8 / llama.cpp Q8_0 decode speed, 1 request", "int8", "Q8_0", "single", None, None),
    ("int8 / llama.cpp Q8_0 tok/s, 16 at once", "int8", "Q8_0", "batch16", None, None),
]
MIXED_GOALS = [("int4 / llama.cpp Q4_0 tok/s, mixed", "int4", "Q4_0", ">=", 1.5),
               ("int8 / llama.cpp Q8_0 tok/s, mixed", "int8", "Q8_0", None, None)]


def speed_ratio(r: dict, a: str, b: str, figure: str) -> float:
    """How many times faster system ``a`` is than ``b`` on ``figure`` within round ``r``."""
    if figure == "single":
        return r[b]["single"]["tpot_median_ms"] / r[a]["single"]["tpot_median_ms"]
    return r[a][figure]["output_tokens_per_s"] / r[b][figure]["output_tokens_per_s"]


def quantize(llama_quantize: Path, gguf: Path, kind: str, out_dir: Path) -> Path:
    """``llama-quantize gguf out kind``; returns the new file (raises CalledProcessError on failure)."""
    out = out_dir / f"{gguf.stem.removesuffix('-f32')}-{kind}.gguf"
    subprocess.run([str(llama_quantize), str(gguf), str(out), kind], check=True, capture_output=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, help="omit the three --llama-* paths: tpserve int4 and int8 only")
    parser.add_argument("--llama-quantize", type=Path)
    parser.add_argument("--llama-gguf", type=Path, help="the float32 GGUF of the benchmark model")
    parser.add_argument("--shape", choices=("m95", "vocab32k"), default="m95",
                        help="m95: the 95M model (vocabulary 512); vocab32k: benchmarks/lm_head_int8.py's 0.16B model "
                             "with a 32,000-token vocabulary (--llama-gguf: build.sh's v32k-f32.gguf)")
    parser.add_argument("--llama-args", default="", help="extra llama-server flags, e.g. \"--no-repack\"")
    parser.add_argument("--tpserve-args", default="", help="extra flags for both tpserve servers, e.g. "
                                                           "\"--num-scheduler-steps 8\"")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-mixed", action="store_true", help="rounds only (a quick check)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default="quantized_peer_comparison.json")
    args = parser.parse_args()
    llama = [args.llama_server, args.llama_quantize, args.llama_gguf]
    if any(llama) and not all(llama):
        parser.error("--llama-server, --llama-quantize and --llama-gguf go together (or none: tpserve only)")
    threads = os.cpu_count() or 1
    loads = workloads(args.seed)
    report: dict = {"machine": machine_description(), "threads": threads, "seed": args.seed, "shape": args.shape,
                    "llama_args": args.llama_args.split(), "tpserve_args": args.tpserve_args.split(), "rounds": []}
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tpserve-qpeer-")))
        model_dir = (build_model(work / "model", args.seed) if args.shape == "m95"
                     else build_real_vocab_model(work / "model", args.seed))
        systems: dict[str, object] = {}
        for q in ("int4", "int8"):
            systems[q] = stack.enter_context(serve(model_dir, 1, "--quantization", q, *args.tpserve_args.split(),
                                                   omp_threads=None)).target
        for kind in ("Q4_0", "Q8_0") if all(llama) else ():
            gguf = quantize(args.llama_quantize, args.llama_gguf, kind, work)
            report.setdefault("gguf_bytes", {})[kind] = gguf.stat().st_size
            systems[kind] = stack.enter_context(LlamaServer(args.llama_server, gguf, threads=threads,
                                                            extra_args=tuple(args.llama_args.split())))

        def run(name: str, reqs: list[tuple[list[int], int]]) -> dict:
            system = systems[name]
            return system.load(reqs) if isinstance(system, LlamaServer) else asyncio.run(_load(system, reqs))

        warm_up = workloads(args.seed, variant=args.rounds + 1)["batch16"][:4]
        for name in systems:
            run(name, warm_up)
        names = list(systems)
        for i in range(args.rounds):
            r = interleaved_round(names, i, workloads(args.seed, variant=i + 1), run)
            report["rounds"].append(r)
            print(f"round {i + 1}: " + "; ".join(f"{what} {speed_ratio(r, a, b, fig):.2f}"
                                                 for what, a, b, fig, _, _ in GOALS if {a, b} <= set(names)),
                  flush=True)
        if not args.skip_mixed:
            report["mixed"] = {name: run(name, loads["mixed"]) for name in names}
    rows = []
    for what, a, b, figure, op, goal in GOALS:
        if not {a, b} <= set(systems):
            continue
        values = [speed_ratio(r, a, b, figure) for r in report["rounds"]]
        x = statistics.median(values)
        rows.append({"what": what, "ratio": round(x, 3), "rounds": [round(v, 3) for v in values],
                     **({"goal": f"{op} {goal}", "met": x >= goal} if goal else {})})
    if "mixed" in report:
        for what, a, b, op, goal in MIXED_GOALS:
            if not {a, b} <= set(systems):
                continue
            x = report["mixed"][a]["output_tokens_per_s"] / report["mixed"][b]["output_tokens_per_s"]
            rows.append({"what": what, "ratio": round(x, 3), **({"goal": f"{op} {goal}", "met": x >= goal}
                                                               if goal else {})})
    report["goals"] = rows
    for row in rows:
        verdict = "" if "met" not in row else ("MET  " if row["met"] else "MISS ")
        print(f"{verdict}{row['what']}: {row['ratio']:.2f}" + (f" (goal {row['goal']})" if "goal" in row else "")
              + (f"  rounds {row['rounds']}" if "rounds" in row else ""))
    if args.out:
        save_report(args.out, args.name, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
