"""Tensor parallelism within hosts and pipeline parallelism across them, against tp across hosts.

Two hosts are network namespaces (tests/cluster/hosts.py; root only, addresses
10.<--subnet>.x.x, 10.201 by default so that it runs beside the two-host tests) whose
link delays each direction by ``--delay-ms``: ``tc netem`` on both ends of a veth pair
where the kernel has ``sch_netem``, else the user-space delay link
(tests/cluster/delay_link.py: a TAP device in each namespace and a forwarder holding
each frame for the delay); ``--link`` forces one, and the output and results say which
applied it. Several delays (``--delay-ms 2 0``) are interleaved in every round. Before
the rounds, a TCP echo measures each delay's round trip and throughput (the link is
not the bottleneck). The same model is served by two layouts of 4 ranks, 2 per host,
interleaved over ``--rounds``:

* ``tp4``: ``--tensor-parallel-size 4 --nnodes 2``: every layer's two all-reduces
  (and the embedding's, and the logits gather) cross the link;
* ``tp2_pp2``: ``--tensor-parallel-size 2 --pipeline-parallel-size 2 --nnodes 2``:
  each host one stage of tp 2 (shared-memory all-reduce within it); one hidden-state
  tensor per tensor-parallel rank and step crosses the link.

Per layout and round: the bytes over the link per step (the leader's end of the
link (veth or TAP), ``/sys/class/net/<if>/statistics/{rx,tx}_bytes``, around one greedy
request of ``--max-tokens`` tokens (ignore_eos, a 4-token prompt):
``--max-tokens`` steps; this counts everything on the link: the activations, the
collectives, the coordinator's step plans and results to the remote ranks and the
liveness checks) and the output tokens/s of 16 such requests at once.

    python benchmarks/pipeline_hosts.py --delay-ms 2 0 --check-goldens --out benchmarks/results \
        --name pipeline_hosts_delay                                    # about 8 minutes

``--check-goldens`` then serves tp2_pp2 at the largest delay and counts the
stories260k goldens that come out token-exact, alone and 16 at once.

Goals: with 2 ms of delay, tp2_pp2 moves >= 4x fewer bytes per step and
makes >= 2x the output tokens/s of tp4.
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
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cluster.hosts import Hosts, netns_unavailable, serve_argv, stop_process_group, two_hosts  # noqa: E402
from tests.cluster.link_probe import probe  # noqa: E402
from tests.paths import STORIES_DIR, load_goldens  # noqa: E402

LAYOUTS = {"tp4": ("--tensor-parallel-size", "4"),
           "tp2_pp2": ("--tensor-parallel-size", "2", "--pipeline-parallel-size", "2")}
PROMPT = "Once upon a time"
PUBLIC_PORT = 50051
MECHANISMS = {"netem": "tc netem on both ends of the veth pair",
              "userspace": "the user-space delay link (tests/cluster/delay_link.py: a TAP device in each namespace, "
                           "a forwarder in the root namespace holding each frame for the delay)",
              "veth": "none: a plain veth pair (every delay asked is 0)"}


def _netns(namespace: str, *argv: str) -> str:
    return subprocess.run(["ip", "netns", "exec", namespace, *argv], check=True, capture_output=True,
                          text=True).stdout


def netem_unavailable() -> str | None:
    """Why ``tc netem`` cannot add delay here (tried on a veth pair in a scratch namespace), or None."""
    namespace = f"tpnetem{os.getpid()}"
    try:
        subprocess.run(["ip", "netns", "add", namespace], check=True, capture_output=True, text=True)
        _netns(namespace, "ip", "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
        _netns(namespace, "tc", "qdisc", "add", "dev", "probe0", "root", "netem", "delay", "1ms")
        return None
    except subprocess.CalledProcessError as exc:
        return f"`{' '.join(exc.cmd)}` failed: {exc.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def set_delay(hosts: Hosts, mechanism: str, delay_ms: float) -> None:
    """Sets the one-way delay of each direction of the A-B link, in milliseconds."""
    if mechanism == "userspace":
        assert hosts.delay is not None
        hosts.delay.set_delay(delay_ms)
    elif mechanism == "netem":
        for namespace, interface in zip((hosts.leader, hosts.headless), hosts.group_link):
            _netns(namespace, "tc", "qdisc", "replace", "dev", interface, "root", "netem", "delay", f"{delay_ms}ms")
    else:
        assert delay_ms == 0, "a plain veth pair adds no delay"


def link_bytes(namespace: str, interface: str) -> int:
    """Bytes received plus sent on ``interface`` (in ``namespace``) since it was created."""
    return sum(int(_netns(namespace, "cat", f"/sys/class/net/{interface}/statistics/{kind}_bytes"))
               for kind in ("rx", "tx"))


def addresses_in_use(client_ip: str) -> int:
    """How many interfaces of this (root) namespace hold ``client_ip`` (the test client's address)."""
    out = subprocess.run(["ip", "-br", "addr"], check=True, capture_output=True, text=True).stdout
    return sum(f" {client_ip}/" in f" {line}" for line in out.splitlines())


@contextmanager
def serving(hosts: Hosts, layout: str, model: str, master_port: int, logs: Path) -> Iterator:
    """Starts ``layout`` over the two hosts; yields a ready client; stops every process on exit."""
    from tpserve.client import Client
    from tpserve.stream_move import MovePolicy

    flags = ["--model", model, *LAYOUTS[layout], "--nnodes", "2", "--master-addr", hosts.leader_ip,
             "--master-port", str(master_port), "--worker-start-timeout-seconds", "300",
             "--step-timeout-seconds", "120", "--distributed-timeout-seconds", "120"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [hosts.run(hosts.leader, "host-a", serve_argv(*flags, "--node-rank", "0", "--host", hosts.leader_public_ip,
                                                          "--port", str(PUBLIC_PORT)), logs / f"{layout}-leader.log", env),
             hosts.run(hosts.headless, "host-b", serve_argv(*flags, "--node-rank", "1", "--headless"),
                       logs / f"{layout}-headless.log", env)]
    client = Client(f"{hosts.leader_public_ip}:{PUBLIC_PORT}", move_policy=MovePolicy(max_moves=0))
    try:
        client.wait_ready(timeout_s=300)
        yield client
    finally:
        client.close()
        for proc in procs:
            stop_process_group(proc)


def forwarder_cpu_s(hosts: Hosts) -> float | None:
    """CPU seconds (user + system) the user-space link's forwarder has used so far; None without one."""
    if hosts.delay is None:
        return None
    fields = Path(f"/proc/{hosts.delay.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: proc(5) fields 14, 15


def measure(hosts: Hosts, layout: str, model: str, max_tokens: int, master_port: int, logs: Path) -> dict:
    """Starts ``layout`` over the two hosts, measures bytes per step and 16-at-once tokens/s, stops it."""
    with serving(hosts, layout, model, master_port, logs) as client:
        one = dict(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        client.generate(PROMPT, **one)  # warm-up
        before = link_bytes(hosts.leader, hosts.group_link[0])
        alone = client.generate(PROMPT, **one)
        bytes_per_step = (link_bytes(hosts.leader, hosts.group_link[0]) - before) / max_tokens
        assert len(alone.token_ids) == max_tokens
        cpu_before = forwarder_cpu_s(hosts)
        started = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda _: client.generate(PROMPT, **one), range(16)))
        seconds = time.monotonic() - started
        cpu_after = forwarder_cpu_s(hosts)
        assert all(r.token_ids == alone.token_ids for r in results)  # the same greedy tokens in the batch
        run = {"bytes_per_step": bytes_per_step, "output_tokens_per_s": 16 * max_tokens / seconds,
               "seconds_16_at_once": seconds, "token_ids": list(alone.token_ids)}
        if cpu_before is not None and cpu_after is not None:  # how busy the user-space link was meanwhile
            run["forwarder_cpu_share_16_at_once"] = (cpu_after - cpu_before) / seconds
        return run


def check_goldens(hosts: Hosts, model: str, master_port: int, logs: Path) -> dict:
    """Every stories260k golden through ``tp2_pp2``, alone and 16 at once: how many come out token-exact."""
    goldens = load_goldens()

    def exact(result, golden: dict) -> bool:
        return (result.token_ids == golden["completion_token_ids"] and result.text == golden["text"]
                and result.finish_reason == golden["finish_reason"])

    with serving(hosts, "tp2_pp2", model, master_port, logs) as client:
        def greedy(golden: dict):
            return client.generate(golden["prompt"], max_tokens=golden["max_tokens"], temperature=0)

        alone = sum(exact(greedy(g), g) for g in goldens)
        batch = [goldens[i % len(goldens)] for i in range(16)]
        with ThreadPoolExecutor(16) as pool:
            together = sum(exact(r, g) for r, g in zip(pool.map(greedy, batch), batch))
    return {"goldens": len(goldens), "token_exact_alone": alone, "sixteen_at_once": len(batch),
            "token_exact_sixteen_at_once": together}


def summarize(runs: dict[str, list[dict]]) -> dict:
    summary = {name: {"bytes_per_step": statistics.median(r["bytes_per_step"] for r in rs),
                      "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in rs)}
               for name, rs in runs.items()}
    bytes_ratio = summary["tp4"]["bytes_per_step"] / summary["tp2_pp2"]["bytes_per_step"]
    speed_ratio = summary["tp2_pp2"]["output_tokens_per_s"] / summary["tp4"]["output_tokens_per_s"]
    per_round = [{"bytes_ratio": t["bytes_per_step"] / p["bytes_per_step"],
                  "tokens_per_s_ratio": p["output_tokens_per_s"] / t["output_tokens_per_s"]}
                 for t, p in zip(runs["tp4"], runs["tp2_pp2"])]
    return {"summary_median": summary, "bytes_ratio_tp4_over_pp": bytes_ratio,
            "tokens_per_s_ratio_pp_over_tp4": speed_ratio, "ratios_per_round": per_round,
            "goals": {"bytes_ratio >= 4": bytes_ratio >= 4, "tokens_per_s_ratio >= 2": speed_ratio >= 2},
            "runs": {name: [{k: v for k, v in r.items() if k != "token_ids"} for r in rs] for name, rs in runs.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(STORIES_DIR))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--delay-ms", type=float, nargs="+", default=[2.0],
                        help="one-way delays of the link, each direction; several are interleaved in every round")
    parser.add_argument("--link", choices=("auto", "netem", "userspace"), default="auto",
                        help="what adds the delay; auto: tc netem where the kernel has it, else the user-space link")
    parser.add_argument("--subnet", type=int, default=201, help="addresses 10.<subnet>.x.x (the tests use 200)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--check-goldens", action="store_true",
                        help="then every stories260k golden through tp2_pp2 at the largest delay")
    parser.add_argument("--out", type=Path, default=None, help="a folder for <name>.json")
    parser.add_argument("--name", default="pipeline_hosts")
    args = parser.parse_args()
    reason = netns_unavailable()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    client_ip = f"10.{args.subnet}.1.1"
    if addresses_in_use(client_ip):
        # Another run holds the same addresses: the client would reach its leader.
        print(f"cannot run: {client_ip} is already in use (another two-host run); try again later or pass --subnet",
              file=sys.stderr)
        return 2
    netem_reason = netem_unavailable()
    if args.link == "netem" and netem_reason:
        print(f"cannot run: {netem_reason}", file=sys.stderr)
        return 2
    if args.link == "auto":
        mechanism = "veth" if not any(args.delay_ms) else ("netem" if netem_reason is None else "userspace")
    else:
        mechanism = args.link
    print(f"delay by: {MECHANISMS[mechanism]}" + (f" (tc netem: {netem_reason})" if netem_reason else ""), flush=True)
    logs = Path(f"/tmp/pipeline_hosts-{os.getpid()}")
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict[float, dict[str, list[dict]]] = {d: {name: [] for name in LAYOUTS} for d in args.delay_ms}
    link_checks: dict[float, dict] = {}
    goldens = None
    with two_hosts(subnet=args.subnet, delay_ms=args.delay_ms[0] if mechanism == "userspace" else None) as hosts:
        for delay_ms in args.delay_ms:
            set_delay(hosts, mechanism, delay_ms)
            check = probe(hosts.headless, hosts.headless_ip, hosts.leader, nbytes=16 << 20)
            link_checks[delay_ms] = {"tcp_rtt_ms_min": min(check["rtt_ms"]),
                                     "tcp_rtt_ms_median": statistics.median(check["rtt_ms"]),
                                     "tcp_echo_mb_per_s_each_way": check["echo_mb_per_s"], "intact": check["intact"]}
            print(f"link at {delay_ms} ms: {link_checks[delay_ms]}", flush=True)
        port = 29500
        for round_index in range(args.rounds):
            for delay_ms in args.delay_ms:
                set_delay(hosts, mechanism, delay_ms)
                for name in LAYOUTS:
                    port += 10  # a fresh rendezvous per start
                    run = measure(hosts, name, args.model, args.max_tokens, port, logs)
                    if addresses_in_use(client_ip) != 1:
                        print("another two-host run started meanwhile: the measurement is void", file=sys.stderr)
                        return 2
                    print(f"round {round_index} delay {delay_ms} ms {name}: {run['bytes_per_step']:.0f} B/step, "
                          f"{run['output_tokens_per_s']:.1f} output tok/s at 16 at once"
                          + (f", forwarder busy {run['forwarder_cpu_share_16_at_once']:.0%}"
                             if "forwarder_cpu_share_16_at_once" in run else ""), flush=True)
                    runs[delay_ms][name].append(run)
        if args.check_goldens:
            set_delay(hosts, mechanism, max(args.delay_ms))
            goldens = {"delay_ms": max(args.delay_ms), **check_goldens(hosts, args.model, port + 10, logs)}
            print(f"goldens: {goldens}", flush=True)
    for by_layout in runs.values():
        assert by_layout["tp4"][0]["token_ids"] == by_layout["tp2_pp2"][0]["token_ids"], "the layouts disagree"
    report = {
        "benchmark": "pipeline_hosts", "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus", "model": args.model, "max_tokens": args.max_tokens,
        "delay_by": MECHANISMS[mechanism], "tc_netem": netem_reason or "available", "rounds": args.rounds,
        "link_check": {f"{d} ms": c for d, c in link_checks.items()},
        "by_delay_ms_each_direction": {f"{d} ms": summarize(r) for d, r in runs.items()},
        "goldens_tp2_pp2": goldens,
    }
    print(json.dumps({d: {k: v for k, v in s.items() if k != "runs"}
                      for d, s in report["by_delay_ms_each_direction"].items()}, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
