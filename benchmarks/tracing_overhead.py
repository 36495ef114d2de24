"""What request timings and tracing cost the engine loop per output token
(docs/design/observability.md, "Request timings and tracing").

The per-step and per-token cost of the coordinator's own Python is what
benchmarks/engine_cpu.py measures (the engine in one process over a worker group that
answers at once; CPU time per output token). This runs that measurement, each in a fresh
process, for three arms in the same rounds, taking turns to go first:

- ``baseline``: another checkout (``--baseline``, e.g. the commit before the timings);
- ``off``: this checkout, tracing off (the default): the timings are on every last output;
- ``on``: this checkout with every request traced (spans to the SDK's in-memory exporter
  through a ``SimpleSpanProcessor``, so the export is inside the measurement too) and every
  16th step's timings kept for the spans' ``step`` events, as the leader does.

Tracing off must cost nothing per step or token: ``off`` / ``baseline`` should be within the
host's noise (the spread of the rounds). ``on`` pays per request, not per token: about five
spans per request. One command, a couple of minutes::

    git worktree add --detach /tmp/base <commit>
    .venv/bin/python benchmarks/tracing_overhead.py --baseline /tmp/base --out benchmarks/results
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


def measure_traced(num_streams: int, max_tokens: int) -> float:
    """engine_cpu's measurement with every request traced (in this process)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from benchmarks.engine_cpu import measure
    from coordinator import metrics, tracing
    from coordinator.request_table import RequestTable

    exporter = InMemorySpanExporter()
    tracing.configure(None, "tpserve-bench", exporter=exporter)
    open_entry = RequestTable.open

    def traced_open(self, *args, **kwargs):  # as a handler does on receipt with tracing on
        entry = open_entry(self, *args, **kwargs)
        entry.trace_context = tracing.extract(())
        return entry

    RequestTable.open = traced_open  # type: ignore[method-assign]

    class SampledMetrics(metrics.Metrics):  # as the leader's with tracing on: every 16th step kept
        def __init__(self) -> None:
            super().__init__()
            tracing.sample_steps(self)

    metrics.Metrics = SampledMetrics  # type: ignore[misc]
    per_token = measure(num_streams, max_tokens, 1)
    assert len(exporter.get_finished_spans()) >= 4 * (num_streams + 4), "every request traced"
    return per_token


def in_checkout(arm: str, checkout: Path, num_streams: int, max_tokens: int) -> float:
    """One measurement (engine CPU s per token) in a fresh process importing ``checkout``'s code."""
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    if arm == "on":
        command = [sys.executable, __file__, "--one-traced", str(num_streams), str(max_tokens)]
    else:
        command = [sys.executable, str(ROOT / "benchmarks" / "engine_cpu.py"), "--one", str(num_streams),
                   str(max_tokens), "1"]
    out = subprocess.run(command, cwd=checkout, env=env, check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, help="another tpserve checkout (the commit before)")
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write tracing_overhead.json here")
    parser.add_argument("--one-traced", nargs=2, type=int, help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    if args.one_traced:
        sys.path.insert(0, str(ROOT))
        print(measure_traced(*args.one_traced))
        return
    arms = {"off": ROOT, "on": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    raw: dict[str, dict[int, list[float]]] = {arm: {n: [] for n in args.streams} for arm in arms}
    for n in args.streams:
        for round_index in range(args.rounds):
            order = list(arms)[round_index % len(arms):] + list(arms)[:round_index % len(arms)]
            for arm in order:
                raw[arm][n].append(in_checkout(arm, arms[arm], n, args.max_tokens) * 1e6)
        row = {arm: round(statistics.median(raw[arm][n]), 1) for arm in arms}
        spread = {arm: round(max(raw[arm][n]) - min(raw[arm][n]), 1) for arm in arms}
        print(f"{n} streams: engine CPU per token (us, median of {args.rounds}) {row}, spread {spread}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"benchmark": "tracing_overhead", "max_tokens": args.max_tokens, "rounds": args.rounds,
                  "baseline": str(args.baseline) if args.baseline else None,
                  "load_average": os.getloadavg(), "num_cpus": os.cpu_count(),
                  "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                  "us_per_token": {arm: {str(n): v for n, v in by_n.items()} for arm, by_n in raw.items()},
                  "median_us_per_token": {arm: {str(n): round(statistics.median(v), 1) for n, v in by_n.items()}
                                          for arm, by_n in raw.items()}}
        path = args.out / "tracing_overhead.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(path)


if __name__ == "__main__":
    main()
