"""The load client's scheduling policy on a shared host: SCHED_OTHER against SCHED_BATCH, one run.

benchmarks/step_overhead.py runs its asyncio client on the host the server runs on, and on
the 2-core test host the client is a third of the CPU a step needs. Under the default policy
each of its wakeups (one per streamed token) preempts whatever runs, often a rank mid-step;
under ``SCHED_BATCH`` (tpserve/sched_policy.py, as the coordinator runs) it waits for a time
slice instead. This measures what that choice moves: one server, every load in a fresh client
process under one policy, the policies taking turns, ``--rounds`` loads each; per policy the
median and mean client TPOT, rank 0's mean execute per step during the load, and the client's
CPU per token::

    .venv/bin/python benchmarks/client_policy.py --streams 16 --rounds 16 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.report import save_report  # noqa: E402
from benchmarks.step_overhead import _load, machine, scrape, serve  # noqa: E402

POLICIES = ("other", "batch")
EXECUTE = "tpserve:model_execute_time_seconds"


def one_load(port: int, streams: int, max_tokens: int, policy: str) -> dict:
    """Runs in the client process: one load under ``policy``; prints its TPOT (s) and CPU per token (s)."""
    from tpserve.sched_policy import set_policy

    if not set_policy(policy):
        raise RuntimeError(f"could not set scheduling policy {policy!r}")
    started = time.process_time()
    tpot, tokens = asyncio.run(_load(port, streams, max_tokens))
    return {"tpot_s": tpot, "client_cpu_per_token_s": (time.process_time() - started) / tokens}


def measure(port: int, metrics_port: int, streams: int, max_tokens: int, policy: str) -> dict:
    """One load in a fresh client process; adds rank 0's mean execute per step over it (s)."""
    before = scrape(metrics_port, f"{EXECUTE}_sum"), scrape(metrics_port, f"{EXECUTE}_count")
    out = subprocess.run([sys.executable, __file__, "--client", str(port), "--streams", str(streams),
                          "--max-tokens", str(max_tokens), "--policy", policy],
                         check=True, capture_output=True, text=True)
    after = scrape(metrics_port, f"{EXECUTE}_sum"), scrape(metrics_port, f"{EXECUTE}_count")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["rank_execute_per_step_s"] = (after[0] - before[0]) / (after[1] - before[1])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--out", type=Path, help="directory for the JSON report")
    parser.add_argument("--client", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--policy", choices=POLICIES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        print(json.dumps(one_load(args.client, args.streams, args.max_tokens, args.policy)))
        return
    rounds: dict[str, list[dict]] = {p: [] for p in POLICIES}
    with ExitStack() as stack:
        _, port, metrics_port = stack.enter_context(serve(REPO, args.tensor_parallel_size, 256, 1))
        measure(port, metrics_port, args.streams, args.max_tokens, "other")  # warm-up
        for r in range(args.rounds):
            for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
                rounds[policy].append(measure(port, metrics_port, args.streams, args.max_tokens, policy))
    summary = {}
    for policy, rows in rounds.items():
        tpots = [row["tpot_s"] for row in rows]
        summary[policy] = {"tpot_median_s": statistics.median(tpots), "tpot_mean_s": statistics.fmean(tpots),
                           "rank_execute_median_s": statistics.median(r["rank_execute_per_step_s"] for r in rows),
                           "client_cpu_per_token_median_s": statistics.median(r["client_cpu_per_token_s"] for r in rows)}
        s = summary[policy]
        print(f"{policy:6s} TPOT median {s['tpot_median_s'] * 1e3:.3f} ms, mean {s['tpot_mean_s'] * 1e3:.3f} ms; "
              f"rank execute {s['rank_execute_median_s'] * 1e3:.3f} ms; "
              f"client CPU {s['client_cpu_per_token_median_s'] * 1e6:.1f} us/token")
    ratios = {key: summary["batch"][key] / summary["other"][key] for key in summary["batch"]}
    print("batch / other: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    if args.out:
        save_report(args.out, "client_policy.json", {
            "machine": machine(), "tensor_parallel_size": args.tensor_parallel_size, "streams": args.streams,
            "max_tokens": args.max_tokens, "summary": summary, "batch_over_other": ratios, "rounds": rounds})


if __name__ == "__main__":
    main()
