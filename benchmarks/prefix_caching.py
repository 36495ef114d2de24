"""TTFT with a shared 400-token prompt prefix, prefix caching on against off, in one run.

For each setting (``--no-enable-prefix-caching``, then ``--enable-prefix-caching``) the
script starts ``tpserve serve``, sends the shared prefix once (it fills the cache when
caching is on; both settings get the same warm-up), then measures, from the client's
stream, the time to first token of N greedy requests made of that prefix and a
distinct suffix: first one after another (TTFT is the prefill alone), then all at once.
Reports TTFT percentiles per setting and the ratio off / on.

    python benchmarks/prefix_caching.py --out benchmarks/results          # embedded model (max length 512)
    python benchmarks/prefix_caching.py --model ../shared/models/stories260k --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.cluster import serve  # noqa: E402  (the same launcher the tests use)
from benchmarks.report import save_report  # noqa: E402


def ttft(client, prompt: list[int], max_tokens: int) -> float:
    """Seconds from sending one streamed greedy request to its first token (the stream is read to its end)."""
    start = time.perf_counter()
    first = None
    for chunk in client.generate_stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        if chunk.token_ids and first is None:
            first = time.perf_counter() - start
    return first


def summarize(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"n": len(values), "mean_ms": round(statistics.fmean(values) * 1e3, 2),
            "p50_ms": round(statistics.median(values) * 1e3, 2),
            "p90_ms": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1e3, 2)}


def run_setting(model: str | None, tp: int, caching: bool, prefix: list[int], prompts: list[list[int]],
                batch: list[list[int]], max_tokens: int) -> dict:
    """One server: the shared prefix alone (warm-up), then ``prompts`` one at a time, then ``batch`` all at once."""
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    with serve(model, tp, flag, omp_threads=None) as cluster:
        client = cluster.client
        client.generate(prefix, max_tokens=1, temperature=0)  # warm-up; with caching on it fills the cache
        sequential = [ttft(client, prompt, max_tokens) for prompt in prompts]
        with ThreadPoolExecutor(len(batch)) as pool:
            concurrent = list(pool.map(lambda p: ttft(client, p, max_tokens), batch))
        hits = cluster.metric("tpserve:prefix_cache_hits_total")
        queries = cluster.metric("tpserve:prefix_cache_queries_total")
    return {"flag": flag, "sequential_ttft": summarize(sequential), "concurrent_ttft": summarize(concurrent),
            "prefix_cache_hits_tokens": hits, "prefix_cache_queries_tokens": queries}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--prefix-len", type=int, default=400)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=None, help="token ids are drawn from [3, vocab-size)")
    parser.add_argument("--out", type=Path, default=None, help="directory for the JSON result")
    args = parser.parse_args()

    vocab = args.vocab_size
    if vocab is None:
        config = Path(args.model) / "config.json" if args.model else Path(__file__).resolve().parents[1] / \
            "tpserve" / "default_model" / "config.json"
        vocab = json.loads(config.read_text())["vocab_size"]
    rng = random.Random(0)
    prefix = [1] + [rng.randrange(3, vocab) for _ in range(args.prefix_len - 1)]  # BOS, then random ids

    def requests() -> list[list[int]]:  # the shared prefix and fresh suffixes
        return [prefix + [rng.randrange(3, vocab) for _ in range(args.suffix_len)] for _ in range(args.num_requests)]

    prompts, batch = requests(), requests()

    report = {"benchmark": "prefix_caching", "model": args.model or "embedded default",
              "tensor_parallel_size": args.tensor_parallel_size, "prefix_len": args.prefix_len,
              "suffix_len": args.suffix_len, "num_requests": args.num_requests, "max_tokens": args.max_tokens,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "load_average_at_start": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    off = run_setting(args.model, args.tensor_parallel_size, False, prefix, prompts, batch, args.max_tokens)
    on = run_setting(args.model, args.tensor_parallel_size, True, prefix, prompts, batch, args.max_tokens)
    report.update(off=off, on=on, load_average_at_end=os.getloadavg())
    report["ratio_off_over_on"] = {
        kind: round(off[kind]["p50_ms"] / on[kind]["p50_ms"], 2) for kind in ("sequential_ttft", "concurrent_ttft")}
    print(json.dumps(report, indent=2))
    if args.out is not None:
        name = "prefix_caching_" + (Path(args.model).name if args.model else "default_model") + ".json"
        save_report(args.out, name, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
