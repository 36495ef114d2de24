"""kill -9 of each rank in turn during a 16-stream greedy load: streams completed token-exact, longest pause.

Serves the model with ``--worker-recovery-timeout-seconds``, records each prompt's
solo greedy output, then for each rank: starts 16 greedy streams, kills the rank
once every stream has its first tokens, and compares every finished stream with
its solo output. The pause is the longest gap between two chunks of any stream.

    python benchmarks/recovery_pause.py --model ../shared/models/stories260k --tensor-parallel-size 2 \\
        --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.cluster import serve  # noqa: E402
from tests.e2e.test_recovery import PROMPTS, _kill_during_load  # noqa: E402
from benchmarks.report import save_report  # noqa: E402

MAX_TOKENS = 64


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="directory for recovery_pause.json")
    args = parser.parse_args()

    requests = [(PROMPTS[i % len(PROMPTS)], dict(temperature=0)) for i in range(16)]
    report = {"model": args.model or "embedded default", "tensor_parallel_size": args.tensor_parallel_size,
              "streams": len(requests), "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
              "kills": []}
    with serve(args.model, args.tensor_parallel_size, "--worker-recovery-timeout-seconds", "120") as cluster:
        solo = [cluster.client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True, **s).token_ids
                for p, s in requests]
        for rank in range(args.tensor_parallel_size):
            results = _kill_during_load(cluster, rank, requests, MAX_TOKENS)
            exact = sum("error" not in r and r["tokens"] == e for r, e in zip(results, solo, strict=True))
            pause = max(r.get("longest_pause_s", 0.0) for r in results)
            cluster.client.wait_ready(timeout_s=60)
            row = {"killed_rank": rank, "token_exact": exact, "longest_pause_s": round(pause, 3)}
            report["kills"].append(row)
            print(json.dumps(row), flush=True)
        report["worker_restarts"] = cluster.metric("tpserve:worker_restarts_total")
    if args.out:
        save_report(args.out, "recovery_pause.json", report)
    return 0 if all(k["token_exact"] == len(requests) for k in report["kills"]) else 1


if __name__ == "__main__":
    sys.exit(main())
