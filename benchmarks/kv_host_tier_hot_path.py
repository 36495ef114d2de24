"""The per-step cost of the host tier's code with the tier off (issue 45): this tree against a baseline tree.

Per tree, in a fresh process each (its code first on ``sys.path``), with the tier off: the median
of 400 steps of ``Scheduler.schedule()`` + ``update()`` over 64 decoding sequences with prefix
caching on, and of the plan's wire round trip (``plan_to_pb``, serialize, parse, ``plan_from_pb``:
what every rank pays per step). The trees take turns, ``--rounds`` times.

    git worktree add /tmp/base main
    .venv/bin/python benchmarks/kv_host_tier_hot_path.py --baseline-repo /tmp/base --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import sys, time, statistics, json
sys.path.insert(0, sys.argv[1])
from coordinator.block_allocator import BlockAllocator
from coordinator.scheduler import Scheduler
from coordinator.sequence import Sequence, StopParams
from tpserve.step import SamplingParams, StepResult
from tpserve.step_pb import plan_to_pb, plan_from_pb
from tpserve.v1 import worker_pb2 as pb

s = Scheduler(BlockAllocator(4096, 16), 64, 4096, enable_prefix_caching=True)
for i in range(64):
    s.add(Sequence(i, [1] + [3 + (i * 7 + j) % 500 for j in range(40)], SamplingParams(temperature=0.0),
                   StopParams(10_000, frozenset()), 4096))
plan = s.schedule(); s.update(plan, StepResult(plan.step_id, tuple(5 for c in plan.scheduled if c.sample)))
sched, wire = [], []
for _ in range(400):
    t = time.perf_counter()
    plan = s.schedule()
    s.update(plan, StepResult(plan.step_id, tuple(5 for c in plan.scheduled if c.sample)))
    sched.append(time.perf_counter() - t)
    t = time.perf_counter()
    plan_from_pb(pb.StepPlan.FromString(plan_to_pb(plan).SerializeToString()))
    wire.append(time.perf_counter() - t)
print(json.dumps({"schedule_update_us": statistics.median(sched) * 1e6, "wire_round_trip_us": statistics.median(wire) * 1e6}))
'''


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-repo", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    trees = {"baseline": args.baseline_repo.resolve(), "candidate": ROOT}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        for name in (("baseline", "candidate") if round_ % 2 == 0 else ("candidate", "baseline")):
            out = subprocess.run([sys.executable, "-c", CHILD, str(trees[name])], capture_output=True, text=True,
                                 check=True).stdout
            runs[name].append(json.loads(out))
    report = {"benchmark": "kv_host_tier_hot_path", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_average": os.getloadavg(), "trees": {k: str(v) for k, v in trees.items()}, "rounds": runs}
    for key in ("schedule_update_us", "wire_round_trip_us"):
        medians = {name: statistics.median(r[key] for r in runs[name]) for name in trees}
        report[key] = {name: round(value, 2) for name, value in medians.items()}
        report[key]["candidate_over_baseline"] = round(medians["candidate"] / medians["baseline"], 4)
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kv_host_tier_hot_path.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
