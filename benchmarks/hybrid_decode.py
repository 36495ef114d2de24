"""Decode tokens/s of a Qwen3.5-shaped hybrid against a dense model of the same size, at 1 and 16 streams (issue 44).

Builds the two checkpoints of benchmarks/hybrid_checkpoints.py (27.6M / 27.8M parameters,
float32), serves both with the real ``tpserve serve`` at once (one rank each, ``--threads``
OpenMP threads), then runs every setting (streams x prompt length) on each in turn, the model
that goes first alternating per round, for ``--rounds`` rounds. Per load: ``streams`` greedy
``ignore_eos`` requests of a fixed random prompt length and ``--max-tokens`` outputs, all sent at
once, each stream's token arrival times taken from the client's stream.

**Decode tokens/s** is taken over the steady window, from the last stream's first token to the
first stream's last token, when every stream is decoding and no prefill runs: output tokens that
arrived in it / its length (one stream: tokens after the first / their time). Prefill and
queueing stay out, so the figure is the decode step's. The ranks' CPU seconds over the same
window (sampled from /proc every 20 ms and interpolated) give **rank CPU ms per decode token**, the
figure that does not move when another engineer's tests take a core.

The ratio hybrid / dense is taken per round (the two loads of one round run back to back), and
the JSON keeps every round; the table reports the median and the spread (min-max) of the rounds.

    .venv/bin/python benchmarks/hybrid_decode.py --out benchmarks/results          # about 6-10 minutes
    .venv/bin/python benchmarks/hybrid_decode.py --quick                         # seconds: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import hybrid_checkpoints  # noqa: E402
from benchmarks.report import save_report  # noqa: E402
from tests.e2e.cluster import rank_pids, serve  # noqa: E402  (the same launcher the tests use)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of ``pids`` (their threads included), seconds."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


class CpuSampler:
    """Samples the ranks' CPU seconds every ``interval_s`` while a load runs, so that the CPU spent in
    any window of it (the steady decode window, known only afterwards) can be interpolated."""

    def __init__(self, pids: list[int], interval_s: float = 0.02) -> None:
        self.pids, self.interval_s, self.samples = pids, interval_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), cpu_seconds(self.pids)))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.perf_counter(), cpu_seconds(self.pids)))

    def at(self, t: float) -> float:
        """CPU seconds at time ``t``, linear between the samples around it."""
        before = max((s for s in self.samples if s[0] <= t), default=self.samples[0])
        after = min((s for s in self.samples if s[0] >= t), default=self.samples[-1])
        if after[0] == before[0]:
            return before[1]
        return before[1] + (after[1] - before[1]) * (t - before[0]) / (after[0] - before[0])


def stream_times(client, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival time of every output token of one streamed greedy request (a chunk's tokens share its time)."""
    times: list[float] = []
    for chunk in client.generate_stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        times.extend([time.perf_counter()] * len(chunk.token_ids))
    return times


def load(cluster, prompts: list[list[int]], max_tokens: int) -> dict:
    """All ``prompts`` at once; decode tokens/s and rank CPU per token over the steady window."""
    with CpuSampler(rank_pids(cluster.process.pid)) as sampler, ThreadPoolExecutor(len(prompts)) as pool:
        start = time.perf_counter()
        streams = list(pool.map(lambda p: stream_times(cluster.client, p, max_tokens), prompts))
        end = time.perf_counter()
    assert all(len(s) == max_tokens for s in streams), [len(s) for s in streams]
    window_start, window_end = max(s[0] for s in streams), min(s[-1] for s in streams)
    # Tokens that arrived after the window opened (the token that opens it was produced before it).
    tokens = sum(sum(1 for t in s if window_start < t <= window_end) for s in streams)
    window = window_end - window_start
    cpu = sampler.at(window_end) - sampler.at(window_start)
    return {"decode_tokens_per_s": round(tokens / window, 2) if window > 0 else None,
            "rank_cpu_ms_per_decode_token": round(cpu / tokens * 1e3, 3) if tokens else None,
            "window_s": round(window, 3), "window_tokens": tokens, "load_wall_s": round(end - start, 3),
            "ttft_max_s": round(window_start - start, 3)}


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 1500])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1,
                        help="OpenMP threads per rank (1: the 2-core host also runs the coordinator and the client)")
    parser.add_argument("--no-kernels", action="store_true",
                        help="serve both with TPSERVE_CPU_KERNELS=0: no compiled CPU kernels, so the dense model loses "
                             "its one-call decode stack too (to attribute the hybrid's gap); writes hybrid_decode_no_kernels.json")
    parser.add_argument("--quick", action="store_true", help="one round, 2 streams, 32-token prompts, 8 outputs")
    parser.add_argument("--out", type=Path, default=None, help="directory for results/hybrid_decode.json")
    parser.add_argument("--suffix", default="", help="appended to the JSON's name (a repeat run keeps the first)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.streams, args.prompt_lens, args.max_tokens = 1, [1, 2], [32], 8
    settings = [(s, p) for p in args.prompt_lens for s in args.streams]
    max_len = max(args.prompt_lens) + args.max_tokens + 16
    flags = ("--max-model-len", str(max(2048, max_len)), "--max-num-seqs", str(max(args.streams)),
             "--kv-cache-memory-bytes", str(1 << 30), "--no-enable-prefix-caching")

    rng = random.Random(44)
    prompts = {(s, p): [[1] + [rng.randrange(3, 512) for _ in range(p - 1)] for _ in range(s)] for s, p in settings}
    report = {"benchmark": "hybrid_decode", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or ''}".strip(", "),
              "load_average_at_start": os.getloadavg(), "omp_threads_per_rank": args.threads,
              "rounds": args.rounds, "max_tokens": args.max_tokens, "server_flags": list(flags),
              "dtype": "float32", "tensor_parallel_size": 1}
    if args.no_kernels:
        os.environ["TPSERVE_CPU_KERNELS"] = "0"  # the servers' ranks inherit it
    report["tpserve_cpu_kernels"] = os.environ.get("TPSERVE_CPU_KERNELS", "1") != "0"
    with tempfile.TemporaryDirectory() as tmp:
        report["models"] = {name: hybrid_checkpoints.save(spec, Path(tmp) / name)
                            for name, spec in (("hybrid", hybrid_checkpoints.HYBRID),
                                               ("dense", hybrid_checkpoints.DENSE))}
        with serve(Path(tmp) / "hybrid", 1, *flags, omp_threads=args.threads) as hybrid, \
                serve(Path(tmp) / "dense", 1, *flags, omp_threads=args.threads) as dense:
            servers = {"hybrid": hybrid, "dense": dense}
            for cluster in servers.values():  # warm-up: first-step costs (allocations, kernels) out of round 0
                load(cluster, [[1] + list(range(3, 34))] * 2, 8)
            rounds = []
            for r in range(args.rounds):
                order = ["hybrid", "dense"] if r % 2 == 0 else ["dense", "hybrid"]
                row = {"round": r, "first": order[0], "load_average": os.getloadavg(), "settings": []}
                for streams, prompt_len in settings:
                    result = {name: load(servers[name], prompts[streams, prompt_len], args.max_tokens)
                              for name in order}
                    entry = {"streams": streams, "prompt_len": prompt_len, **result}
                    h, d = result["hybrid"], result["dense"]
                    if h["decode_tokens_per_s"] and d["decode_tokens_per_s"]:
                        entry["tokens_per_s_hybrid_over_dense"] = round(
                            h["decode_tokens_per_s"] / d["decode_tokens_per_s"], 3)
                        entry["cpu_per_token_hybrid_over_dense"] = round(
                            h["rank_cpu_ms_per_decode_token"] / d["rank_cpu_ms_per_decode_token"], 3)
                    row["settings"].append(entry)
                    print(json.dumps(entry), flush=True)
                rounds.append(row)
    summary = []
    for i, (streams, prompt_len) in enumerate(settings):
        entries = [row["settings"][i] for row in rounds]

        def of(key: str, name: str | None = None) -> dict | None:
            values = [(e[name][key] if name else e.get(key)) for e in entries]
            values = [v for v in values if v is not None]
            return spread(values) if values else None

        summary.append({"streams": streams, "prompt_len": prompt_len,
                        "hybrid_decode_tokens_per_s": of("decode_tokens_per_s", "hybrid"),
                        "dense_decode_tokens_per_s": of("decode_tokens_per_s", "dense"),
                        "tokens_per_s_hybrid_over_dense": of("tokens_per_s_hybrid_over_dense"),
                        "hybrid_rank_cpu_ms_per_token": of("rank_cpu_ms_per_decode_token", "hybrid"),
                        "dense_rank_cpu_ms_per_token": of("rank_cpu_ms_per_decode_token", "dense"),
                        "cpu_per_token_hybrid_over_dense": of("cpu_per_token_hybrid_over_dense")})
    report.update(rounds=rounds, summary=summary, load_average_at_end=os.getloadavg())
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        name = "hybrid_decode" + ("_quick" if args.quick else "") + ("_no_kernels" if args.no_kernels else "") + args.suffix
        print(save_report(args.out, name + ".json", report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
