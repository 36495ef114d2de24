"""The coordinator's CPU time per output token (the per-token goal: at most 40 µs at 64 and 256 streams).

Starts ``tpserve serve`` (the embedded default model, tp 1) for this checkout and, with
``--baseline DIR``, for another checkout of tpserve (a ``git worktree`` of the commit to
compare with) at the same time; then, for each number of concurrent streams, runs
``--rounds`` rounds, each round one batch of streams against every server in turn
(interleaved, so that a neighbour's load hits both alike). Each stream asks for
``--max-tokens`` greedy tokens with ``ignore_eos``. The coordinator's CPU time is read
from ``/proc/<pid>/stat`` (utime + stime: the process's own, every thread, gRPC's
included; not its worker ranks') before and after the batch:

    coordinator CPU per output token = Δ(utime + stime) / output tokens received

The ratio candidate / baseline is what to compare across machines. One command,
bounded: about 2-4 minutes on a quiet 2-core machine with the defaults.

    git worktree add --detach /tmp/tpserve-main main
    .venv/bin/python benchmarks/coordinator_cpu.py --baseline /tmp/tpserve-main --out benchmarks/results

``--also NAME=DIR`` adds further checkouts (another branch, a merge) to the same rounds.
``--stream-interval N...`` serves this checkout once per interval (``--stream-interval``
of ``tpserve serve``: tokens per stream message; 1 is the default), named ``candidate``
for 1 and ``candidate_siN`` otherwise, all in the same rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import save_report  # noqa: E402
from tests.e2e.cluster import free_port  # noqa: E402
from tpserve.client import AsyncClient, Client, build_request  # noqa: E402
from tpserve.stream_move import MovePolicy  # noqa: E402

PROMPTS = ["Once upon a time", "Lily wanted to", "The dog", "Tom and Sue went to the park.", "One day, a little bird"]
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` in seconds (every thread; children not included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # fields 14 and 15 of proc(5)


@contextmanager
def server(checkout: Path, max_num_seqs: int, log_path: Path | None, extra_args: tuple[str, ...] = ()):
    """``tpserve serve`` of the checkout ``checkout`` (its code imported first, ``extra_args`` added);
    yields (pid, target)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    # The launch package holds the CLI now; older checkouts (baselines) have it in tpserve.
    cli = "launch.cli" if (checkout / "launch" / "cli.py").is_file() else "tpserve.cli"
    cmd = [sys.executable, "-m", cli, "serve", "--tensor-parallel-size", "1", "--host", "127.0.0.1",
           "--port", str(port), "--metrics-port", str(free_port()), "--max-num-seqs", str(max_num_seqs),
           "--max-num-batched-tokens", str(max(2048, max_num_seqs * 8)), *extra_args]
    log_file = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below
    process = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    target = f"127.0.0.1:{port}"
    try:
        with Client(target, move_policy=MovePolicy(max_moves=0)) as client:
            client.wait_ready(timeout_s=180)
        yield process.pid, target
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        if log_path:
            log_file.close()


async def one_batch(target: str, num_streams: int, max_tokens: int) -> tuple[int, int, float]:
    """``num_streams`` concurrent streams; returns (output tokens received, stream messages, wall seconds)."""
    requests = [build_request(PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, temperature=0, ignore_eos=True)
                for i in range(num_streams)]
    async with AsyncClient(target) as client:
        async def stream(request) -> tuple[int, int]:
            num_tokens = num_messages = 0
            async for response in client.stub.GenerateStream(request):
                num_tokens += len(response.token_ids)
                num_messages += 1
            return num_tokens, num_messages

        start = time.perf_counter()
        counts = await asyncio.gather(*(stream(r) for r in requests))
        return sum(c[0] for c in counts), sum(c[1] for c in counts), time.perf_counter() - start


def measure(pid: int, target: str, num_streams: int, max_tokens: int) -> dict:
    before = cpu_seconds(pid)
    num_tokens, num_messages, wall = asyncio.run(one_batch(target, num_streams, max_tokens))
    cpu = cpu_seconds(pid) - before
    assert num_tokens == num_streams * max_tokens, f"{num_tokens} tokens for {num_streams} x {max_tokens}"
    return {"cpu_us_per_token": round(cpu / num_tokens * 1e6, 1), "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
            "tokens_per_s": round(num_tokens / wall, 1), "tokens_per_message": round(num_tokens / num_messages, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="another tpserve checkout to measure beside this one")
    parser.add_argument("--also", action="append", default=[], metavar="NAME=DIR",
                        help="a further checkout to measure in the same run (repeatable)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--stream-interval", type=int, nargs="+", default=[1],
                        help="serve this checkout once per interval (tokens per stream message)")
    parser.add_argument("--out", type=Path, help="write the report (--name) into this directory")
    parser.add_argument("--name", default="coordinator_cpu.json", help="the report's file name")
    parser.add_argument("--log-dir", type=Path, help="write each server's log here")
    args = parser.parse_args()
    load_average_start = os.getloadavg()
    checkouts = {("candidate" if i == 1 else f"candidate_si{i}"): ROOT for i in args.stream_interval}
    extra = {name: ("--stream-interval", name.removeprefix("candidate_si")) for name in checkouts if name != "candidate"}
    checkouts |= {"baseline": args.baseline.resolve()} if args.baseline else {}
    checkouts |= {name: Path(path).resolve() for name, _, path in (also.partition("=") for also in args.also)}
    max_num_seqs = max(args.streams)
    results: dict[str, dict[int, list[dict]]] = {name: {n: [] for n in args.streams} for name in checkouts}
    with ExitStack() as stack:
        servers = {name: stack.enter_context(server(path, max_num_seqs, args.log_dir / f"{name}.log"
                                                    if args.log_dir else None, extra.get(name, ())))
                   for name, path in checkouts.items()}
        for pid, target in servers.values():  # warm-up: first requests compile and allocate
            measure(pid, target, 4, 8)
        for num_streams in args.streams:
            for round_index in range(args.rounds):
                order = list(servers) if round_index % 2 == 0 else list(reversed(servers))
                for name in order:
                    row = measure(*servers[name], num_streams, args.max_tokens)
                    results[name][num_streams].append(row)
                    print(f"{name:9s} streams={num_streams:4d} round={round_index} {row}", flush=True)
    table = []
    for num_streams in args.streams:
        row = {"streams": num_streams}
        for name in checkouts:
            row[f"{name}_cpu_us_per_token"] = statistics.median(r["cpu_us_per_token"] for r in results[name][num_streams])
            row[f"{name}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in results[name][num_streams])
            row[f"{name}_tokens_per_message"] = statistics.median(r["tokens_per_message"] for r in results[name][num_streams])
        if "baseline" in checkouts:
            for name in checkouts:
                if name != "baseline":
                    row[f"{name}_ratio"] = round(row[f"{name}_cpu_us_per_token"] / row["baseline_cpu_us_per_token"], 3)
        for name in checkouts:
            row[f"{name}_goal_40us"] = "yes" if row[f"{name}_cpu_us_per_token"] <= 40 else "no"
        table.append(row)
        print(row)
    report = {"benchmark": "coordinator_cpu", "model": "embedded default", "tensor_parallel_size": 1,
              "stream_intervals": args.stream_interval,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "machine": platform.platform(),
              "processor": platform.processor(), "num_cpus": os.cpu_count(),
              "load_average_start": load_average_start, "load_average": os.getloadavg(),
              "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
              "table": table, "rounds_raw": results}
    if args.out:
        print(save_report(args.out, args.name, report))


if __name__ == "__main__":
    main()
