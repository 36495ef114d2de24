"""Tensor parallelism within hosts and pipeline parallelism across them, against tp across hosts (issue 25).

Two hosts are network namespaces joined by a veth pair (tests/cluster/hosts.py; root
only), with ``tc netem`` adding ``--delay-ms`` of delay to each direction of that
link (both ends' egress). The same model is served by two layouts of 4 ranks, 2 per
host, interleaved over ``--rounds``:

* ``tp4``: ``--tensor-parallel-size 4 --nnodes 2``: every layer's two all-reduces
  (and the embedding's, and the logits gather) cross the link;
* ``tp2_pp2``: ``--tensor-parallel-size 2 --pipeline-parallel-size 2 --nnodes 2``:
  each host one stage of tp 2 (shared-memory all-reduce within it); one hidden-state
  tensor per tensor-parallel rank and step crosses the link.

Per layout and round: the bytes over the link per step (the leader's end of the
veth pair, ``/sys/class/net/<if>/statistics/{rx,tx}_bytes``, around one greedy
request of ``--max-tokens`` tokens (ignore_eos, a 4-token prompt):
``--max-tokens`` steps; this counts everything on the link: the activations, the
collectives, the coordinator's step plans and results to the remote ranks and the
liveness checks) and the output tokens/s of 16 such requests at once.

    python benchmarks/pipeline_hosts.py --out benchmarks/results      # about 3 minutes

Goals (issue 25): tp2_pp2 moves >= 4x fewer bytes per step and makes >= 2x the
output tokens/s of tp4. On a kernel without ``sch_netem`` (``tc`` answers "Specified
qdisc kind is unknown") no delay is added and the report says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cluster.hosts import (CLIENT_IP, LEADER_IP, LEADER_PUBLIC_IP, netns_unavailable,  # noqa: E402
                                 serve_argv, stop_process_group, two_hosts)
from tests.paths import STORIES_DIR  # noqa: E402

LAYOUTS = {"tp4": ("--tensor-parallel-size", "4"),
           "tp2_pp2": ("--tensor-parallel-size", "2", "--pipeline-parallel-size", "2")}
PROMPT = "Once upon a time"
PUBLIC_PORT = 50051


def _netns(namespace: str, *argv: str) -> str:
    return subprocess.run(["ip", "netns", "exec", namespace, *argv], check=True, capture_output=True,
                          text=True).stdout


def link_bytes(namespace: str, interface: str) -> int:
    """Bytes received plus sent on ``interface`` (in ``namespace``) since it was created."""
    return sum(int(_netns(namespace, "cat", f"/sys/class/net/{interface}/statistics/{kind}_bytes"))
               for kind in ("rx", "tx"))


def addresses_in_use() -> int:
    """How many interfaces of this (root) namespace hold the test client's address (tests/cluster/hosts.py)."""
    out = subprocess.run(["ip", "-br", "addr"], check=True, capture_output=True, text=True).stdout
    return sum(f" {CLIENT_IP}/" in f" {line}" for line in out.splitlines())


def measure(hosts, link: tuple[str, str], layout: str, model: str, max_tokens: int, master_port: int,
            logs: Path) -> dict:
    """Starts ``layout`` over the two hosts, measures bytes per step and 16-at-once tokens/s, stops it."""
    from tpserve.client import Client
    from tpserve.stream_move import MovePolicy

    flags = ["--model", model, *LAYOUTS[layout], "--nnodes", "2", "--master-addr", LEADER_IP,
             "--master-port", str(master_port), "--worker-start-timeout-seconds", "300",
             "--step-timeout-seconds", "120", "--distributed-timeout-seconds", "120"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [hosts.run(hosts.leader, "host-a", serve_argv(*flags, "--node-rank", "0", "--host", LEADER_PUBLIC_IP,
                                                          "--port", str(PUBLIC_PORT)), logs / f"{layout}-leader.log", env),
             hosts.run(hosts.headless, "host-b", serve_argv(*flags, "--node-rank", "1", "--headless"),
                       logs / f"{layout}-headless.log", env)]
    client = Client(f"{LEADER_PUBLIC_IP}:{PUBLIC_PORT}", move_policy=MovePolicy(max_moves=0))
    try:
        client.wait_ready(timeout_s=300)
        one = dict(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        client.generate(PROMPT, **one)  # warm-up
        before = link_bytes(hosts.leader, link[0])
        alone = client.generate(PROMPT, **one)
        bytes_per_step = (link_bytes(hosts.leader, link[0]) - before) / max_tokens
        assert len(alone.token_ids) == max_tokens
        started = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda _: client.generate(PROMPT, **one), range(16)))
        seconds = time.monotonic() - started
        assert all(r.token_ids == alone.token_ids for r in results)  # the same greedy tokens in the batch
        return {"bytes_per_step": bytes_per_step, "output_tokens_per_s": 16 * max_tokens / seconds,
                "seconds_16_at_once": seconds, "token_ids": list(alone.token_ids)}
    finally:
        client.close()
        for proc in procs:
            stop_process_group(proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(STORIES_DIR))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--delay-ms", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    reason = netns_unavailable()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    if addresses_in_use():
        # Another run of the two-host tests holds the same fixed addresses: the client would reach its leader.
        print(f"cannot run: {CLIENT_IP} is already in use (a two-host test is running); try again later",
              file=sys.stderr)
        return 2
    logs = Path(f"/tmp/pipeline_hosts-{os.getpid()}")
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    with two_hosts() as hosts:
        tag = os.getpid() % 100000  # tests/cluster/hosts.py names the group link's ends tga<tag> / tgb<tag>
        link = (f"tga{tag}", f"tgb{tag}")
        delay_ms: float | str = args.delay_ms
        for namespace, interface in ((hosts.leader, link[0]), (hosts.headless, link[1])):
            try:
                if args.delay_ms:
                    _netns(namespace, "tc", "qdisc", "add", "dev", interface, "root", "netem", "delay",
                           f"{args.delay_ms}ms")
            except subprocess.CalledProcessError as exc:  # a kernel without sch_netem
                delay_ms = f"none: tc netem failed ({exc.stderr.strip()})"
                print(f"no delay added: {delay_ms}", file=sys.stderr)
                break
        port = 29500
        for round_index in range(args.rounds):
            for name in LAYOUTS:
                port += 10  # a fresh rendezvous per start
                run = measure(hosts, link, name, args.model, args.max_tokens, port, logs)
                if addresses_in_use() != 1:
                    print("another two-host run started meanwhile: the measurement is void", file=sys.stderr)
                    return 2
                print(f"round {round_index} {name}: {run['bytes_per_step']:.0f} B/step, "
                      f"{run['output_tokens_per_s']:.1f} output tok/s at 16 at once", flush=True)
                runs[name].append(run)
    assert runs["tp4"][0]["token_ids"] == runs["tp2_pp2"][0]["token_ids"], "the layouts disagree on greedy tokens"
    summary = {name: {"bytes_per_step": statistics.median(r["bytes_per_step"] for r in rs),
                      "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in rs)}
               for name, rs in runs.items()}
    bytes_ratio = summary["tp4"]["bytes_per_step"] / summary["tp2_pp2"]["bytes_per_step"]
    speed_ratio = summary["tp2_pp2"]["output_tokens_per_s"] / summary["tp4"]["output_tokens_per_s"]
    report = {
        "benchmark": "pipeline_hosts", "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus", "model": args.model, "max_tokens": args.max_tokens,
        "delay_ms_each_direction": delay_ms, "rounds": args.rounds,
        "summary_median": summary, "bytes_ratio_tp4_over_pp": bytes_ratio, "tokens_per_s_ratio_pp_over_tp4": speed_ratio,
        "goals": {"bytes_ratio >= 4": bytes_ratio >= 4, "tokens_per_s_ratio >= 2": speed_ratio >= 2},
        "runs": {name: [{k: v for k, v in r.items() if k != "token_ids"} for r in rs] for name, rs in runs.items()},
    }
    print(json.dumps({k: report[k] for k in ("summary_median", "bytes_ratio_tp4_over_pp",
                                              "tokens_per_s_ratio_pp_over_tp4", "goals")}, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "pipeline_hosts.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
