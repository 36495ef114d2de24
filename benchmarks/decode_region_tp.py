"""The decode region on tensor-parallel ranks, and its own barrier, against a baseline tree in one run.

Two measurements on the 94.9M-parameter random Llama of benchmarks/peer_comparison.py (float32 checkpoint,
quantized at load), each taking turns between the baseline tree (``--baseline-repo``: a checkout whose
tensor-parallel ranks run a decode step as each layer's halves around ``ctx.all_reduce``, and whose region's
barriers are ``omp barrier``) and this one:

* ``served_tp2``: ``tpserve serve --tensor-parallel-size 2`` of each tree, int4 and int8, the rank threads the
  server's own rule gives (one each on a 2-core host). Per round, one stream of 128 greedy tokens after a
  32-token prompt (the client's TPOT, benchmarks/peer_comparison.py's ``single`` load) and 16 streams at once
  (``batch16``: output tokens per second); every server is up for the whole run, and the rounds alternate which
  tree goes first. Medians over ``--rounds``.
* ``bare_stack_tp1``: the compiled stack's decode step alone (``DecodeLayers.forward``, batch 1, 32 positions of
  context, tp 1, the host's threads) in a fresh process per tree and wait policy: libgomp's default, and
  ``OMP_WAIT_POLICY=passive``, under which ``omp barrier`` sleeps in the kernel at once.

    git worktree add --detach /tmp/base <commit>
    python benchmarks/decode_region_tp.py --baseline-repo /tmp/base --out benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.peer_comparison import _load, build_model, workloads  # noqa: E402
from benchmarks.report import save_report  # noqa: E402
from benchmarks.step_overhead import serve  # noqa: E402  (a tree's server)

FORMATS = ("int4", "int8")
#: Run in a fresh process of a tree: the median time of its compiled stack's batch-1 decode step (ms).
BARE_STACK = """
import statistics, sys, time
from pathlib import Path
import torch
import worker.layers.decode_block as db
from benchmarks.peer_comparison import bare_runner, bare_steps
runner = bare_runner(Path(sys.argv[1]), quantization=sys.argv[2])
captured = {}
call = db.DecodeStack.__call__
def capture(self, rope, h, kv_caches, meta):
    captured["args"] = (self, rope, h.clone(), kv_caches, meta)
    return call(self, rope, h, kv_caches, meta)
db.DecodeStack.__call__ = capture
bare_steps(runner, [1], 32, steps=10)
stack, rope, h, kv_caches, meta = captured["args"]
k, v, scales = stack._step_caches(kv_caches)
args = db._step_args(meta)
forward = stack._compiled.forward
for _ in range(50):
    forward(h, *rope, k, v, *args, scales)
times = []
for _ in range(300):
    start = time.perf_counter()
    forward(h, *rope, k, v, *args, scales)
    times.append(time.perf_counter() - start)
print(statistics.median(times) * 1e3)
"""


def served(trees: dict[str, Path], model_dir: Path, rounds: int) -> dict:
    """Per format and tree: the median single-stream TPOT (ms) and batch16 throughput (tokens/s), with rounds."""
    out: dict = {}
    with ExitStack() as stack:
        targets = {}
        for fmt in FORMATS:
            for name, tree in trees.items():
                # The server's own thread rule (None): one a rank on 2 cores.
                _, port, _ = stack.enter_context(serve(tree, 2, 64, None, ("--model", str(model_dir),
                                                                            "--quantization", fmt)))
                targets[(fmt, name)] = f"127.0.0.1:{port}"
        for target in targets.values():  # warm-up: kernels, caches, the first prefill
            asyncio.run(_load(target, workloads(0, 99)["batch16"][:4]))
        tpot: dict = {key: [] for key in targets}
        throughput: dict = {key: [] for key in targets}
        for i in range(rounds):
            order = list(targets.items()) if i % 2 == 0 else list(targets.items())[::-1]
            for key, target in order:
                tpot[key].append(asyncio.run(_load(target, workloads(0, i + 1)["single"]))["tpot_median_ms"])
            for key, target in order:
                throughput[key].append(asyncio.run(_load(target, workloads(0, 50 + i)["batch16"]))["output_tokens_per_s"])
    for fmt in FORMATS:
        row: dict = {}
        for name in trees:
            row[name] = {"tpot_ms": round(statistics.median(tpot[(fmt, name)]), 3),
                         "batch16_tokens_per_s": round(statistics.median(throughput[(fmt, name)]), 1),
                         "tpot_rounds_ms": [round(x, 3) for x in tpot[(fmt, name)]],
                         "batch16_rounds": [round(x, 1) for x in throughput[(fmt, name)]]}
        if "baseline" in row:
            row["tpot_baseline_over_candidate"] = round(row["baseline"]["tpot_ms"] / row["candidate"]["tpot_ms"], 3)
            row["batch16_candidate_over_baseline"] = round(
                row["candidate"]["batch16_tokens_per_s"] / row["baseline"]["batch16_tokens_per_s"], 3)
        out[fmt] = row
    return out


def bare_stack(trees: dict[str, Path], model_dir: Path, rounds: int) -> dict:
    """Per format, wait policy and tree: the compiled stack's median batch-1 step (ms) over the rounds."""
    out: dict = {}
    for fmt in FORMATS:
        for policy in ("default", "passive"):
            times: dict = {name: [] for name in trees}
            for i in range(rounds):
                names = list(trees) if i % 2 == 0 else list(trees)[::-1]
                for name in names:
                    env = dict(os.environ, PYTHONPATH=str(trees[name]))
                    env.pop("OMP_NUM_THREADS", None)
                    if policy == "passive":
                        env["OMP_WAIT_POLICY"] = "passive"
                    run = subprocess.run([sys.executable, "-c", BARE_STACK, str(model_dir), fmt], cwd=trees[name],
                                         env=env, check=True, capture_output=True, text=True)
                    times[name].append(float(run.stdout.strip().splitlines()[-1]))
            row: dict = {name: round(statistics.median(t), 3) for name, t in times.items()}
            row["rounds"] = {name: [round(x, 3) for x in t] for name, t in times.items()}
            if "baseline" in row:
                row["baseline_over_candidate"] = round(row["baseline"] / row["candidate"], 3)
            out[f"{fmt}/{policy}"] = row
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-repo", type=Path, required=True, help="the baseline tree (a git worktree)")
    parser.add_argument("--model-dir", type=Path, default=None, help="the 95M checkpoint (default: built, seed 0)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="directory for the report")
    parser.add_argument("--name", default="decode_region_tp.json")
    args = parser.parse_args()
    trees = {"baseline": args.baseline_repo.resolve(), "candidate": REPO}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or Path(tmp) / "model"
        if args.model_dir is None:
            build_model(model_dir, 0)
        for tree in trees.values():  # each tree's kernels, built before anything is timed
            subprocess.run([sys.executable, "-m", "worker.kernels"], cwd=tree, check=True, capture_output=True,
                           env=dict(os.environ, PYTHONPATH=str(tree)))
        report = {
            "machine": f"{platform.machine()} {os.cpu_count()} cores",
            "baseline": subprocess.run(["git", "-C", str(trees["baseline"]), "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True).stdout.strip(),
            "candidate": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True).stdout.strip(),
            "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "served_tp2": served(trees, model_dir, args.rounds),
            "bare_stack_tp1": bare_stack(trees, model_dir, max(3, args.rounds // 2 + 1)),
        }
    print(json.dumps(report, indent=2))
    if args.out is not None:
        print("wrote", save_report(args.out, args.name, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
