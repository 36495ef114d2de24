"""The fixed cost of a step (docs/design/scheduling.md, "The engine loop"): client TPOT against the bare ``ModelRunner.execute`` decode step.

For each tensor-parallel size and number of streams (each ``--max-tokens`` output tokens,
``ignore_eos``, seeded sampling), on the embedded model:

- bare step: the mean ``ModelRunner.execute`` of pure decode plans at that many sequences,
  built in-process as the scheduler plans (benchmarks/step_overhead_bare.py), over the
  positions the load decodes at (the server's prompt length, then ``--max-tokens`` - 1 steps:
  TPOT is the mean over the same steps, and attention grows with the position);
- client TPOT: every stream's (last token time - first token time) / (tokens - 1), seen by
  an asyncio client through the full gRPC path (``tpserve serve``), mean over streams; the
  client runs under ``SCHED_BATCH``, as the coordinator does, so that its wakeups do not
  preempt the ranks it shares the host with;
- TPOT / bare;
- coordinator CPU per output token: the coordinator process's own CPU time
  (``/proc/<pid>/stat`` utime + stime, its threads included, no rank, no client) over the
  load, divided by the tokens streamed;
- the ranks' CPU time per output token (every rank process, ``/proc``) and this client's
  (``time.process_time``: the asyncio client and its gRPC threads), and how busy the three kept
  the cores this benchmark may use over the load: (coordinator + ranks + client CPU) / (wall x
  cores). On a host whose cores they share, near 100 % says that TPOT is what their CPU time
  allows, whatever overlaps what: client TPOT / bare can then fall only with less CPU per token;
- rank wait: rank 0's mean wait per step between sending a result and receiving the next
  plan (``tpserve:worker_wait_seconds``; "-" on a tree that does not export it), and rank
  0's mean execute time per step inside the server (``tpserve:model_execute_time_seconds``)
  with TPOT over it: the same ratio as TPOT / bare, measured during the load itself, so a
  busy host moves both sides alike.

Then every goal with its verdict: TPOT / bare <= 1.2 at 16 and 64 streams
(each tp), coordinator CPU <= 40 us per token at 64 and 256 streams, bare step at 64 <= 3 ms.

With ``--baseline-repo PATH`` another checkout (say ``git worktree add /tmp/base main``)
serves too, in the same run: both servers are up at once and each load runs on the baseline,
then on this tree, alternately; the bare steps likewise. One command, bounded (about three
minutes on an idle 2-core host)::

    .venv/bin/python benchmarks/step_overhead.py --baseline-repo /tmp/base --out benchmarks/results

``--variant NAME=FLAGS`` serves this tree once more with extra ``tpserve serve`` flags, in the
same rounds, with this tree's bare step (e.g. ``--variant "async=--async-scheduling"``).

``--rounds R`` runs every load R times (and the bare steps before each), the trees taking turns
to go first; each cell is then the median of its R rounds, and the report keeps every round.
On a shared 2-core host one round moves by 10-30 % from the next: compare trees over rounds.
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
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.report import save_report  # noqa: E402
from tpserve.sched_policy import set_policy  # noqa: E402
from tests.e2e.cluster import child_pids, free_port  # noqa: E402

PROMPT = "Once upon a time, there was a little"
CLK_TCK = os.sysconf("SC_CLK_TCK")
GOALS = "TPOT / bare <= 1.2 at 16 and 64 streams; coordinator CPU <= 40 us/token at 64 and 256; bare step at 64 <= 3 ms"


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far, all its threads (``/proc/<pid>/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def scrape(metrics_port: int, name: str) -> float | None:
    """One unlabelled sample from /metrics; None when the server does not export it."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


@contextmanager
def serve(tree: Path, tensor_parallel_size: int, max_num_seqs: int, threads: int | None, extra: tuple[str, ...] = ()):
    """``tpserve serve`` of ``tree``'s code (cwd and PYTHONPATH), ``threads`` torch threads per rank (None: the
    server's own rule, the host's cores split among the ranks), ``extra`` flags: yields (pid, port, metrics port)."""
    from tpserve.client import Client

    port, metrics_port = free_port(), free_port()
    # As many threads per rank as the bare step has: the ratio compares like with like.
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads))
    if threads is None:
        env.pop("OMP_NUM_THREADS")
    cli = "launch.cli" if (tree / "launch" / "cli.py").is_file() else "tpserve.cli"  # older trees: tpserve.cli
    cmd = [sys.executable, "-m", cli, "serve", "--tensor-parallel-size", str(tensor_parallel_size),
           "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
           "--max-num-seqs", str(max_num_seqs), *extra]
    process = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = Client(f"127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"tpserve serve of {tree} exited with {process.returncode} during start-up")
            try:
                client.wait_ready(timeout_s=1.0)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
        yield process.pid, port, metrics_port
    finally:
        client.close()
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


async def _load(port: int, num_streams: int, max_tokens: int) -> tuple[float, int]:
    """Runs ``num_streams`` streams at once; returns (mean TPOT in seconds, tokens received)."""
    from tpserve.client import AsyncClient

    async with AsyncClient(f"127.0.0.1:{port}") as client:
        async def one(index: int) -> tuple[float, int]:
            first = last = 0.0
            count = 0
            async for chunk in client.generate_stream(PROMPT, max_tokens=max_tokens, ignore_eos=True, seed=index):
                if chunk.token_ids:
                    last = time.perf_counter()
                    first = first or last
                    count += len(chunk.token_ids)
            return (last - first) / max(count - 1, 1), count

        results = await asyncio.gather(*(one(i) for i in range(num_streams)))
    return sum(r[0] for r in results) / len(results), sum(r[1] for r in results)


def run_load(server: tuple[int, int, int], num_streams: int, max_tokens: int) -> dict:
    """One load on one server: TPOT, the CPU time per token of the coordinator, of the ranks and of
    this client, how busy they kept the host's cores, and rank 0's mean wait and execute per step."""
    pid, port, metrics_port = server
    names = ("tpserve:worker_wait_seconds", "tpserve:model_execute_time_seconds")
    before = [(scrape(metrics_port, f"{n}_sum"), scrape(metrics_port, f"{n}_count")) for n in names]
    ranks = child_pids(pid)
    cpu_before, ranks_before = cpu_seconds(pid), sum(map(cpu_seconds, ranks))
    client_before, wall_before = time.process_time(), time.perf_counter()
    # The client runs as the coordinator does, under SCHED_BATCH (tpserve/sched_policy.py): it
    # shares the ranks' cores only because the benchmark runs on one host, and under the default
    # policy each of its wakeups (one per streamed token) preempts a rank mid-step. Measured at tp 1
    # and 16 streams on the 2-core host by benchmarks/client_policy.py (results/client_policy.json,
    # 20 loads each): TPOT 0.85x (median), the client's CPU per token 0.66x.
    set_policy("batch")
    try:
        tpot, tokens = asyncio.run(_load(port, num_streams, max_tokens))
    finally:
        set_policy("other")  # the bare steps' processes start from this one: they inherit its policy
    wall, client = time.perf_counter() - wall_before, time.process_time() - client_before
    cpu, ranks_cpu = cpu_seconds(pid) - cpu_before, sum(map(cpu_seconds, ranks)) - ranks_before
    after = [(scrape(metrics_port, f"{n}_sum"), scrape(metrics_port, f"{n}_count")) for n in names]
    means = [None if None in b + a or a[1] <= b[1] else (a[0] - b[0]) / (a[1] - b[1]) for b, a in zip(before, after)]
    return {"tpot_s": tpot, "tokens": tokens, "coordinator_cpu_s": cpu, "coordinator_cpu_per_token_s": cpu / tokens,
            "ranks_cpu_per_token_s": ranks_cpu / tokens, "client_cpu_per_token_s": client / tokens,
            "host_busy": (cpu + ranks_cpu + client) / (wall * len(os.sched_getaffinity(0))),
            "rank_wait_per_step_s": means[0], "rank_execute_per_step_s": means[1]}


def prompt_tokens(port: int) -> int:
    """How many tokens the server makes of PROMPT (its tokenizer, special tokens included)."""
    from tpserve.client import Client

    with Client(f"127.0.0.1:{port}") as client:
        return client.generate(PROMPT, max_tokens=1, ignore_eos=True).usage.prompt_tokens


def bare_steps(tree: Path, tensor_parallel_size: int, sizes: list[int], num_steps: int, prompt_len: int,
               threads: int) -> dict[str, float]:
    """The bare decode step on ``tree``'s runner, in a fresh process: rank 0's mean over ``num_steps``
    decode steps from position ``prompt_len`` (seconds)."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_overhead_bare.py"),
                          "--model-dir", str(tree / "tpserve" / "default_model"),
                          "--tensor-parallel-size", str(tensor_parallel_size),
                          "--sizes", ",".join(map(str, sizes)), "--steps", str(num_steps),
                          "--prompt-len", str(prompt_len)],
                         cwd=tree, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_row(rounds: list[dict]) -> dict:
    """Each field's median over a load's rounds (None where a server did not export it)."""
    row = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds if r[key] is not None]
        row[key] = statistics.median(values) if values else None
    if len(rounds) > 1:
        row["rounds"] = rounds
    return row


def verdicts(rows: dict[str, dict[str, dict]]) -> list[dict]:
    """Issue 26's goals over one tree's rows (keyed by tp, then streams)."""
    goals = []
    for tp, by_streams in rows.items():
        for n in ("16", "64"):
            if n in by_streams:
                ratio = by_streams[n]["tpot_s"] / by_streams[n]["bare_step_s"]
                goals.append({"goal": f"TPOT / bare at {n} streams, tp {tp}", "value": round(ratio, 2),
                              "limit": 1.2, "met": ratio <= 1.2})
        for n in ("64", "256"):
            if n in by_streams:
                us = by_streams[n]["coordinator_cpu_per_token_s"] * 1e6
                goals.append({"goal": f"coordinator CPU per token at {n} streams, tp {tp} (us)",
                              "value": round(us, 1), "limit": 40, "met": us <= 40})
        if "64" in by_streams:
            ms = by_streams["64"]["bare_step_s"] * 1e3
            goals.append({"goal": f"bare step at 64 sequences, tp {tp} (ms)", "value": round(ms, 2), "limit": 3,
                          "met": ms <= 3})
    return goals


def print_table(name: str, rows: dict[str, dict[str, dict]]) -> None:
    print(f"\n{name}")
    print("| tp | streams | bare decode step | client TPOT | TPOT / bare | coordinator CPU per output token "
          "| rank wait per step | rank 0 execute per step (in the server) | TPOT / execute "
          "| ranks' / client's CPU per token | host CPU busy |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for tp, by_streams in rows.items():
        for n, row in by_streams.items():
            wait, execute = row["rank_wait_per_step_s"], row["rank_execute_per_step_s"]
            print(f"| {tp} | {n} | {row['bare_step_s'] * 1e3:.2f} ms | {row['tpot_s'] * 1e3:.2f} ms | "
                  f"{row['tpot_s'] / row['bare_step_s']:.2f}x | {row['coordinator_cpu_per_token_s'] * 1e6:.0f} us | "
                  + ("- | - | - |" if wait is None else
                     f"{wait * 1e3:.2f} ms | {execute * 1e3:.2f} ms | {row['tpot_s'] / execute:.2f}x |")
                  + f" {row['ranks_cpu_per_token_s'] * 1e6:.0f} / {row['client_cpu_per_token_s'] * 1e6:.0f} us | "
                    f"{row['host_busy'] * 100:.0f} % |")
    for goal in verdicts(rows):
        print(f"  {goal['goal']}: {goal['value']} (limit {goal['limit']}) -> {'met' if goal['met'] else 'NOT met'}")


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "load_average_at_start": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensor-parallel-size", default="1,2", help="comma-separated tp sizes")
    parser.add_argument("--streams", default="1,16,64,256", help="comma-separated numbers of concurrent streams")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per stream")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank, bare step and server alike")
    parser.add_argument("--baseline-repo", type=Path, default=None,
                        help="another checkout whose code serves the baseline, interleaved in this run")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="serve this tree again with these extra flags (space-separated), same rounds")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of every load (trees alternating who goes first); cells are medians")
    parser.add_argument("--out", type=Path, default=None, help="write step_overhead.json into this directory")
    args = parser.parse_args()
    tps = [int(t) for t in args.tensor_parallel_size.split(",")]
    sizes = [int(s) for s in args.streams.split(",")]
    trees = {"candidate": REPO} if args.baseline_repo is None else {"baseline": args.baseline_repo.resolve(),
                                                                    "candidate": REPO}
    flags: dict[str, tuple[str, ...]] = {name: () for name in trees}
    for variant in args.variant:
        name, _, extra = variant.partition("=")
        trees[name], flags[name] = REPO, tuple(extra.split())
    started = time.monotonic()
    report: dict = {"machine": machine(), "goals": GOALS, "max_tokens": args.max_tokens, "threads": args.threads,
                    "rounds": args.rounds,
                    "trees": {name: str(tree) for name, tree in trees.items()},
                    "flags": {name: list(extra) for name, extra in flags.items()}, "rows": {n: {} for n in trees}}
    for tp in tps:
        with ExitStack() as stack:
            servers = {name: stack.enter_context(serve(tree, tp, max(sizes), args.threads, flags[name]))
                       for name, tree in trees.items()}
            for name in trees:  # warm-up: the first requests pay one-time costs
                run_load(servers[name], 4, 8)
            # The bare step decodes at the positions the loads' TPOT averages over.
            prompt_len = prompt_tokens(servers["candidate"][1])
            report["prompt_tokens"] = prompt_len
            for n in sizes:
                # Interleaved, each bare step just before the loads: machine noise falls on every tree and column.
                # A variant shares its tree's bare step (same code, other flags).
                loads: dict[str, list[dict]] = {name: [] for name in trees}
                for r in range(args.rounds):
                    bare_of = {tree: bare_steps(tree, tp, [n], args.max_tokens - 1, prompt_len, args.threads)[str(n)]
                               for tree in dict.fromkeys(trees.values())}
                    for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):  # who goes first alternates
                        loads[name].append({**run_load(servers[name], n, args.max_tokens),
                                            "bare_step_s": bare_of[trees[name]]})
                for name in trees:
                    report["rows"][name].setdefault(str(tp), {})[str(n)] = median_row(loads[name])
    report["seconds"] = round(time.monotonic() - started, 1)
    report["verdicts"] = {name: verdicts(rows) for name, rows in report["rows"].items()}
    for name, tree in trees.items():
        print_table(f"{name}: {tree}", report["rows"][name])
    print(f"\n{report['seconds']} s; machine: {report['machine']}")
    if args.out is not None:
        print("written", save_report(args.out, "step_overhead.json", report))


if __name__ == "__main__":
    main()
