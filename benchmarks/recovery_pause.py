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

With ``--hosts 2``, a lost host of a two-host group (network namespaces, as
tests/cluster/test_two_hosts.py; root only): tp 4 as 2 + 2, 16 streams; the headless
host's process group is killed with SIGKILL once every stream has its first tokens and
started again ``--away-seconds`` later. The pauses: from the host's return to the first
resumed token of every stream (the restart), and the longest gap any stream saw.
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
from tests.paths import STORIES_DIR  # noqa: E402
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


def host_loss(model: str, max_tokens: int, away_s: float) -> dict:
    """Kills the headless host of a two-host group mid-stream and starts it again ``away_s`` later."""
    import tempfile
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tests.cluster.hosts import LEADER_PUBLIC_IP, serve_argv, stop_process_group, two_hosts, wait_for_text
    from tests.cluster.test_two_hosts import PUBLIC_PORT, group_flags
    from tpserve.client import Client
    from tpserve.stream_move import MovePolicy

    requests = [(PROMPTS[i % len(PROMPTS)], dict(temperature=0) if i % 2 else dict(temperature=0.9, seed=i))
                for i in range(16)]
    logs = Path(tempfile.mkdtemp(prefix="recovery-pause-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = [f if f != str(STORIES_DIR) else model for f in group_flags(0)]
    procs = []
    with two_hosts() as hosts:
        def start_headless():
            headless_flags = [f if f != str(STORIES_DIR) else model for f in group_flags(1)]
            procs.append(hosts.run(hosts.headless, "host-b", serve_argv(*headless_flags), logs / "headless.log", env))
            return procs[-1]

        client = Client(f"{LEADER_PUBLIC_IP}:{PUBLIC_PORT}", move_policy=MovePolicy(max_moves=0))
        try:
            procs.append(hosts.run(hosts.leader, "host-a", serve_argv(*flags, "--worker-recovery-timeout-seconds",
                                                                      "120"), logs / "leader.log", env))
            wait_for_text(logs / "leader.log", "waiting for nodes", 60)
            headless = start_headless()
            client.wait_ready(timeout_s=300)
            with ThreadPoolExecutor(16) as pool:
                solo = list(pool.map(lambda r: client.generate(r[0], max_tokens=max_tokens, ignore_eos=True,
                                                               **r[1]).token_ids, requests))
            started, returned = threading.Barrier(len(requests) + 1), [0.0]

            def one(request) -> tuple[list[int], float, float]:
                tokens, last, longest, first_after = [], time.monotonic(), 0.0, 0.0
                for chunk in client.generate_stream(request[0], max_tokens=max_tokens, ignore_eos=True,
                                                    timeout_s=600, **request[1]):
                    now = time.monotonic()
                    longest, last = (max(longest, now - last) if tokens else 0.0), now
                    if returned[0] and not first_after and chunk.token_ids:
                        first_after = now - returned[0]
                    tokens.extend(chunk.token_ids)
                    if len(tokens) == 2:
                        started.wait(120)
                return tokens, longest, first_after

            with ThreadPoolExecutor(16) as pool:
                futures = [pool.submit(one, r) for r in requests]
                started.wait(120)
                os.killpg(headless.pid, signal.SIGKILL)
                time.sleep(away_s)
                returned[0] = time.monotonic()
                start_headless()
                results = [f.result() for f in futures]
        finally:
            client.close()
            for proc in procs:
                stop_process_group(proc)
    return {"hosts": 2, "tensor_parallel_size": 4, "streams": len(requests), "away_s": away_s,
            "token_exact": sum(r[0] == e for r, e in zip(results, solo, strict=True)),
            "host_back_to_first_resumed_token_s": {"max": round(max(r[2] for r in results), 3),
                                                   "median": round(statistics.median(r[2] for r in results), 3)},
            "longest_pause_s": round(max(r[1] for r in results), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="directory for recovery_pause.json")
    parser.add_argument("--replicas", type=int, choices=(1, 2), default=1,
                        help="2: kill one of two replicas (streams move) instead of a rank")
    parser.add_argument("--hosts", type=int, choices=(1, 2), default=1,
                        help="2: kill the headless host of a two-host group (network namespaces; root)")
    parser.add_argument("--away-seconds", type=float, default=3.0, help="--hosts 2: the host returns after this")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    args = parser.parse_args()
    if args.hosts == 2:
        report = {"model": args.model or str(STORIES_DIR),
                  "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
                  **host_loss(args.model or str(STORIES_DIR), args.max_tokens, args.away_seconds)}
        print(json.dumps(report), flush=True)
        if args.out:
            save_report(args.out, "recovery_pause_host_loss.json", report)
        return 0 if report["token_exact"] == report["streams"] else 1
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
