"""Continuous batching against one-request-at-a-time, on one running tpserve cluster.

Starts ``tpserve serve`` for the model at each tensor-parallel degree, then sends the
same N greedy requests twice: one after another (the baseline), and all at once (the
continuous-batching case). Reports output tokens per second for both and their ratio,
with TTFT and TPOT percentiles measured by the client from the stream. The ratio is
what to compare across machines; absolute numbers depend on the machine.

    python benchmarks/serving_throughput.py --model ../shared/models/stories260k \
        --tensor-parallel-size 1 2 --num-requests 32 --max-tokens 64 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.cluster import serve  # noqa: E402  (the same launcher the tests use)
from benchmarks.report import save_report  # noqa: E402

PROMPTS = ["Once upon a time", "Lily wanted to", "The dog", "Tom and Sue went to the park.", "One day, a little bird"]


def timed_stream(client, prompt: str, max_tokens: int) -> dict:
    """One streamed request: tokens, TTFT and mean TPOT in seconds."""
    start = time.perf_counter()
    first = None
    num_tokens = 0
    for chunk in client.generate_stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        if chunk.token_ids and first is None:
            first = time.perf_counter()
        num_tokens += len(chunk.token_ids)
    end = time.perf_counter()
    return {"tokens": num_tokens, "ttft": first - start, "tpot": (end - first) / max(num_tokens - 1, 1), "e2e": end - start}


def run_phase(client, num_requests: int, max_tokens: int, concurrency: int) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: timed_stream(client, p, max_tokens), prompts))
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)

    def pct(key: str, q: float) -> float:
        values = sorted(r[key] for r in results)
        return values[min(len(values) - 1, int(q * len(values)))]

    return {
        "concurrency": concurrency, "wall_s": round(wall, 3), "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_ms": round(pct("ttft", 0.5) * 1e3, 2), "ttft_p99_ms": round(pct("ttft", 0.99) * 1e3, 2),
        "tpot_p50_ms": round(statistics.median(r["tpot"] for r in results) * 1e3, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="directory for the JSON result")
    args = parser.parse_args()

    report = {"model": args.model or "embedded default", "num_requests": args.num_requests,
              "max_tokens": args.max_tokens, "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
              "runs": []}
    for tp in args.tensor_parallel_size:
        with serve(args.model, tp) as cluster:
            run_phase(cluster.client, 4, 8, 4)  # warm-up
            sequential = run_phase(cluster.client, args.num_requests, args.max_tokens, 1)
            batched = run_phase(cluster.client, args.num_requests, args.max_tokens, args.num_requests)
        run = {"tensor_parallel_size": tp, "sequential": sequential, "batched": batched,
               "throughput_ratio": round(batched["output_tokens_per_s"] / sequential["output_tokens_per_s"], 2)}
        report["runs"].append(run)
        print(json.dumps(run), flush=True)
    if args.out:
        # The model is named inside the report; the file keeps one fixed name.
        save_report(args.out, "serving_throughput.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
