"""kill -9 of each rank in turn during a 16-stream greedy load: streams completed token-exact, longest pause.

Serves the model with ``--worker-recovery-timeout-seconds``, records each prompt's
solo greedy output, then for each rank: starts 16 greedy streams, kills the rank
once every stream has its first tokens, and compares every finished stream with
its solo output. The pause is the longest gap between two chunks of any stream.

    python benchmarks/recovery_pause.py --model ../shared/models/stories260k --tensor-parallel-size 2 \\
        --out benchmarks/results

With ``--replicas 2``, a lost replica instead: two single-group replicas behind one
``ipv4:`` target, 16 streams (greedy and seeded sampled) through ``AsyncClient``; one
replica's process group is killed with SIGKILL once every stream has its first tokens.
The streams it held move to the other replica (tpserve/stream_move.py); the pause is,
per moved stream, the time from the break to its first token from the other replica.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.cluster import serve  # noqa: E402
from tests.e2e.test_recovery import PROMPTS, _kill_during_load  # noqa: E402
from benchmarks.report import save_report  # noqa: E402

MAX_TOKENS = 64


def replica_loss(model: str | None, tensor_parallel_size: int, max_tokens: int) -> dict:
    """Kills one of two replicas mid-stream; every stream's tokens against the unfaulted replica's."""
    from tpserve.client import AsyncClient
    from tpserve.stream_move import MovePolicy, StreamMove

    requests = [(PROMPTS[i % len(PROMPTS)], dict(temperature=0) if i % 2 else dict(temperature=0.9, seed=i))
                for i in range(16)]
    with ExitStack() as stack:
        doomed = stack.enter_context(serve(model, tensor_parallel_size, new_session=True))
        kept = stack.enter_context(serve(model, tensor_parallel_size, new_session=True))
        solo = [kept.client.generate(p, max_tokens=max_tokens, ignore_eos=True, **s).token_ids for p, s in requests]
        breaks: dict[str, float] = {}

        def on_move(move: StreamMove) -> None:
            breaks.setdefault(move.request_id, time.monotonic())

        async def load() -> tuple[list[list[int]], list[float]]:
            tokens: list[list[int]] = [[] for _ in requests]
            pauses: list[float] = []
            async with AsyncClient(f"ipv4:{doomed.target},{kept.target}",
                                   move_policy=MovePolicy(on_move=on_move)) as client:
                for _ in range(8):
                    await client.model_info()  # round_robin connected to both before the load

                async def one(index: int, prompt: str, sampling: dict) -> None:
                    async for chunk in client.generate_stream(prompt, max_tokens=max_tokens, ignore_eos=True,
                                                              request_id=f"r{index}", **sampling):
                        if chunk.token_ids and f"r{index}" in breaks and index not in moved:
                            moved.add(index)
                            pauses.append(time.monotonic() - breaks[f"r{index}"])
                        tokens[index].extend(chunk.token_ids)

                moved: set[int] = set()
                tasks = [asyncio.create_task(one(i, p, s)) for i, (p, s) in enumerate(requests)]
                while min(len(t) for t in tokens) < 2:
                    await asyncio.sleep(0.005)
                os.killpg(doomed.process.pid, signal.SIGKILL)
                await asyncio.gather(*tasks)
            return tokens, pauses

        tokens, pauses = asyncio.run(load())
    return {"replicas": 2, "streams": len(requests), "moved": len(breaks),
            "token_exact": sum(t == e for t, e in zip(tokens, solo, strict=True)),
            "break_to_first_token_s": {"max": round(max(pauses, default=0.0), 3),
                                       "median": round(statistics.median(pauses), 3) if pauses else None}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="directory for recovery_pause.json")
    parser.add_argument("--replicas", type=int, choices=(1, 2), default=1,
                        help="2: kill one of two replicas (streams move) instead of a rank")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    args = parser.parse_args()
    if args.replicas == 2:
        report = {"model": args.model or "embedded default", "tensor_parallel_size": args.tensor_parallel_size,
                  "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
                  **replica_loss(args.model, args.tensor_parallel_size, args.max_tokens)}
        print(json.dumps(report), flush=True)
        if args.out:
            save_report(args.out, "recovery_pause_replica_loss.json", report)
        return 0 if report["token_exact"] == report["streams"] and report["moved"] else 1

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
