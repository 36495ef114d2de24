"""TTFT of a 2,000-token prompt on a Qwen3.5-shaped hybrid whose first 1,800 tokens were served before, caching on against off (issue 44).

The hybrid of benchmarks/hybrid_checkpoints.py (float32, ``--max-model-len 2048``) is served
twice at once, ``--enable-prefix-caching`` and ``--no-enable-prefix-caching``. Each round draws a
fresh random 1,800-token prefix ``P`` and a 200-token suffix ``S`` (fresh, so that no round hits
what an earlier one left), and on each server, in the round's order (alternating):

1. sends ``P`` alone (one output token): on the caching server it fills the KV blocks and saves
   the DeltaNet state at every block boundary of the prompt (docs/design/scheduling.md, "Hybrid
   models' state cache"); the other server does the same work and keeps nothing;
2. measures the TTFT of ``P + S`` (greedy, 4 output tokens), and the prompt tokens the prefix
   cache served it (``tpserve:prefix_cache_hits`` before and after) and whether it resumed from a
   saved state (``tpserve:prefix_cache_state_hits``);
3. on the caching server only, the TTFT of a fresh 2,000-token prompt sharing nothing (the cold
   request: caching's own cost, saving 125 checkpoints, without any hit; ``cold_over_off``).

With 16-token blocks the hit must be 1,792 tokens (112 blocks, the longest block boundary <= 1,800
whose state was saved); the script fails if any cached request gets another count or no state
hit. Reports per-round TTFTs, medians and spreads, and the ratios off / cached and cold / cached.

    .venv/bin/python benchmarks/hybrid_prefix_cache.py --out benchmarks/results     # 2-4 minutes
    .venv/bin/python benchmarks/hybrid_prefix_cache.py --quick                     # a smoke run
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import hybrid_checkpoints  # noqa: E402
from benchmarks.report import save_report  # noqa: E402
from tests.e2e.cluster import serve  # noqa: E402  (the same launcher the tests use)

BLOCK_SIZE = 16


def ttft(client, prompt: list[int]) -> float:
    """Seconds from sending one streamed greedy request to its first token (the stream is read to its end)."""
    start = time.perf_counter()
    first = None
    for chunk in client.generate_stream(prompt, max_tokens=4, temperature=0, ignore_eos=True):
        if chunk.token_ids and first is None:
            first = time.perf_counter() - start
    return first


def counters(cluster) -> tuple[float, float]:
    return (cluster.metric("tpserve:prefix_cache_hits_total"), cluster.metric("tpserve:prefix_cache_state_hits_total"))


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefix-len", type=int, default=1800)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="the step's token budget (the default: each prompt is one chunk; less splits it)")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per rank")
    parser.add_argument("--quick", action="store_true", help="one round, a 180-token prefix of a 200-token prompt")
    parser.add_argument("--out", type=Path, default=None, help="directory for results/hybrid_prefix_cache.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.prefix_len, args.prompt_len = 1, 180, 200
    expected_hit = args.prefix_len // BLOCK_SIZE * BLOCK_SIZE
    common = ("--max-model-len", "2048", "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "4",
              "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--kv-cache-memory-bytes", str(1 << 30))
    rng = random.Random(4400)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    report = {"benchmark": "hybrid_prefix_cache", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_average_at_start": os.getloadavg(),
              "omp_threads_per_rank": args.threads, "rounds": args.rounds, "prefix_len": args.prefix_len,
              "prompt_len": args.prompt_len, "block_size": BLOCK_SIZE, "expected_cached_tokens": expected_hit,
              "server_flags": list(common), "dtype": "float32", "tensor_parallel_size": 1}
    with tempfile.TemporaryDirectory() as tmp:
        report["model"] = hybrid_checkpoints.save(hybrid_checkpoints.HYBRID, Path(tmp) / "hybrid")
        with serve(Path(tmp) / "hybrid", 1, *common, "--enable-prefix-caching", omp_threads=args.threads) as on, \
                serve(Path(tmp) / "hybrid", 1, *common, "--no-enable-prefix-caching", omp_threads=args.threads) as off:
            for cluster in (on, off):  # warm-up: first-step costs out of round 0 (a prompt no round shares)
                ttft(cluster.client, [1] + tokens(args.prompt_len - 1))
            rounds = []
            for r in range(args.rounds):
                prefix = [1] + tokens(args.prefix_len - 1)
                prompt = prefix + tokens(args.prompt_len - args.prefix_len)
                cold_prompt = [1] + tokens(args.prompt_len - 1)
                row = {"round": r, "load_average": os.getloadavg()}
                for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
                    cluster = on if name == "on" else off
                    cluster.client.generate(prefix, max_tokens=1, temperature=0)
                    hits, state_hits = counters(cluster)
                    row[f"ttft_{name}_s"] = round(ttft(cluster.client, prompt), 4)
                    after = counters(cluster)
                    row[f"cached_tokens_{name}"] = int(after[0] - hits)
                    row[f"state_hits_{name}"] = int(after[1] - state_hits)
                    if name == "on":
                        row["ttft_cold_s"] = round(ttft(cluster.client, cold_prompt), 4)
                        row["cached_tokens_cold"] = int(counters(cluster)[0] - after[0])
                row["off_over_cached"] = round(row["ttft_off_s"] / row["ttft_on_s"], 3)
                row["cold_over_cached"] = round(row["ttft_cold_s"] / row["ttft_on_s"], 3)
                # Caching's own cost on a miss: the chunk split at every block boundary, 125 states saved.
                row["cold_over_off"] = round(row["ttft_cold_s"] / row["ttft_off_s"], 3)
                print(json.dumps(row), flush=True)
                rounds.append(row)
    summary = {key: spread([row[key] for row in rounds])
               for key in ("ttft_on_s", "ttft_off_s", "ttft_cold_s", "off_over_cached", "cold_over_cached",
                             "cold_over_off")}
    summary["cached_tokens_on"] = sorted({row["cached_tokens_on"] for row in rounds})
    summary["state_hits_on"] = sorted({row["state_hits_on"] for row in rounds})
    summary["cached_tokens_off_and_cold"] = sorted({row["cached_tokens_off"] for row in rounds} |
                                                   {row["cached_tokens_cold"] for row in rounds})
    report.update(rounds=rounds, summary=summary, load_average_at_end=os.getloadavg())
    print(json.dumps(summary, indent=1))
    ok = summary["cached_tokens_on"] == [expected_hit] and summary["state_hits_on"] == [1] \
        and summary["cached_tokens_off_and_cold"] == [0]
    report["cached_tokens_as_expected"] = ok
    if args.out is not None:
        suffix = "_quick" if args.quick else ("" if args.max_num_batched_tokens == 2048
                                              else f"_chunk{args.max_num_batched_tokens}")
        print(save_report(args.out, f"hybrid_prefix_cache{suffix}.json", report))
    if not ok:
        print(f"cached tokens {summary['cached_tokens_on']} (expected {expected_hit}), state hits "
              f"{summary['state_hits_on']}, without caching {summary['cached_tokens_off_and_cold']}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
