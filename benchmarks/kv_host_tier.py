"""The prefix cache's host tier (issue 45), side by side in one run: tier off against tier on.

1. **Repeated long prompts** (``repeat``): W distinct prompts of 1,500 tokens, each sent R+1 times
   in turn (one at a time, greedy, streamed), through a device pool that holds one of them (128
   blocks of 16 = 2,048 tokens), so every repeat finds its prompt evicted. Off: each repeat computes
   the prompt again. On (``--num-cpu-blocks-override``, ten times the pool): each repeat copies its
   93 full blocks back from the host tier and computes the last block. Reports TTFT of the repeats.
2. **0 % reuse** (``no_reuse``): N distinct 1,500-token prompts, C at a time, through the same
   pool: every admission evicts, so the tier-on server copies every evicted block out and never
   reads one back: the tier's whole cost. Reports output + prompt tokens per second.

Both servers are up at once and the settings alternate, round after round (``--rounds``), so that
the load of this shared host falls on both alike; each figure is the median over the rounds.

3. **0 % reuse in one process** (``no_reuse_in_process``): the same load through the scheduler and
   a ``ModelRunner`` in this process, tier off and on alternately, with the host-tier copies timed
   on their own: the seconds they take against the steps' seconds is the tier's cost with none of
   the serving path's noise (a served run's throughput moves 10-30 % between rounds on this host).

The model is the embedded one with ``max_position_embeddings`` raised to 2,048 (a copy; RoPE's
default rotation extends to any position; tokens are not checked here, the tests do that).

    .venv/bin/python benchmarks/kv_host_tier.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.cluster import serve  # noqa: E402  (the same launcher the tests use)
from benchmarks.prefix_caching import summarize, ttft  # noqa: E402
from benchmarks.report import save_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16
POOL_BLOCKS = 128  # 2,048 tokens: one max_model_len sequence, one of the long prompts at a time
TIER_BLOCKS = 1280  # ten times the pool


def long_model(directory: Path) -> Path:
    """The embedded model with 2,048 positions, copied to ``directory``."""
    shutil.copytree(ROOT / "tpserve" / "default_model", directory)
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def throughput(client, prompts: list[list[int]], concurrency: int, max_tokens: int) -> float:
    """Prompt + output tokens per second over ``prompts``, ``concurrency`` at a time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: client.generate(p, max_tokens=max_tokens, temperature=0, ignore_eos=True),
                                prompts))
    elapsed = time.perf_counter() - start
    return sum(r.usage.prompt_tokens + r.usage.completion_tokens for r in results) / elapsed


def in_process_cost(model: Path, prompts: list[list[int]], rounds: int, max_tokens: int,
                    concurrency: int) -> dict:
    """Tier off and on, alternately: the steps' seconds, and (on) the host-tier copies' seconds within them."""
    import torch

    from coordinator.block_allocator import BlockAllocator
    from coordinator.kv_host_tier import HostTier
    from coordinator.scheduler import Scheduler
    from coordinator.sequence import Sequence, StopParams
    from tpserve.step import SamplingParams
    from worker.model_runner import ModelRunner
    from worker.parallel_state import ParallelContext

    runners = {}
    for name, slots in (("off", 0), ("on", TIER_BLOCKS)):
        runners[name] = ModelRunner(model, ParallelContext.single(), torch.float32, block_size=BLOCK_SIZE)
        runners[name].init_kv_cache(POOL_BLOCKS, num_host_blocks=slots)
    tier = runners["on"].host_tier
    assert tier is not None
    copy_s = [0.0]
    copy = tier.copy

    def timed_copy(*args) -> None:
        start = time.perf_counter()
        copy(*args)
        copy_s[0] += time.perf_counter() - start

    tier.copy = timed_copy  # type: ignore[method-assign]
    step_s: dict[str, list[float]] = {"off": [], "on": []}
    copies: list[float] = []
    num_stores = 0
    for round_ in range(-1, rounds):  # round -1: a warm-up of each, not recorded
        for name in (("off", "on") if round_ % 2 == 0 else ("on", "off")):
            host = HostTier(TIER_BLOCKS, BLOCK_SIZE) if name == "on" else None
            scheduler = Scheduler(BlockAllocator(POOL_BLOCKS, BLOCK_SIZE), concurrency, 2048,
                                  enable_prefix_caching=True, host_tier=host)
            for i, p in enumerate(prompts):
                scheduler.add(Sequence(i, list(p), SamplingParams(temperature=0.0),
                                       StopParams(max_tokens, frozenset()), 2048))
            copy_s[0], total = 0.0, 0.0
            with torch.inference_mode():
                while scheduler.has_work():
                    plan = scheduler.schedule()
                    start = time.perf_counter()
                    result = runners[name].execute(plan)
                    total += time.perf_counter() - start
                    scheduler.update(plan, result)
            if round_ < 0:
                continue
            step_s[name].append(total)
            if host is not None:
                copies.append(copy_s[0])
                num_stores = host.num_stores
                assert host.num_hits == 0  # 0 % reuse: nothing is read back
    median_on = statistics.median(step_s["on"])
    return {"step_seconds_rounds": {k: [round(v, 3) for v in vals] for k, vals in step_s.items()},
            "step_seconds_median": {k: round(statistics.median(v), 3) for k, v in step_s.items()},
            "on_over_off_step_seconds": round(median_on / statistics.median(step_s["off"]), 4),
            "copy_seconds_rounds": [round(c, 4) for c in copies],
            "copy_share_of_step_seconds": round(statistics.median(copies) / median_on, 4),
            "blocks_copied_to_host_per_round": num_stores,
            "bytes_per_block": runners["on"].kv_layout.bytes_per_block}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=1500)
    parser.add_argument("--working-set", type=int, default=3, help="distinct prompts repeated (W)")
    parser.add_argument("--repeats", type=int, default=2, help="repeats of each prompt per round (R)")
    parser.add_argument("--no-reuse-requests", type=int, default=16, help="distinct prompts of the 0 %% reuse load")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="directory for the JSON result")
    args = parser.parse_args()
    rng = random.Random(45)
    vocab = json.loads((ROOT / "tpserve" / "default_model" / "config.json").read_text())["vocab_size"]

    def prompt() -> list[int]:
        return [1] + [rng.randrange(3, vocab) for _ in range(args.prompt_len - 1)]

    common = ("--block-size", str(BLOCK_SIZE), "--max-model-len", "2048", "--num-gpu-blocks-override",
              str(POOL_BLOCKS), "--max-num-batched-tokens", "2048")
    settings = {"off": common, "on": (*common, "--num-cpu-blocks-override", str(TIER_BLOCKS))}
    report: dict = {"benchmark": "kv_host_tier", "model": "embedded default, 2,048 positions",
                    "block_size": BLOCK_SIZE, "pool_blocks": POOL_BLOCKS, "tier_blocks": TIER_BLOCKS,
                    "args": vars(args) | {"out": str(args.out)},
                    "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                    "load_average_at_start": os.getloadavg(),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    repeat_ttft: dict[str, list[float]] = {"off": [], "on": []}
    cold_ttft: dict[str, list[float]] = {"off": [], "on": []}
    rates: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        model = long_model(Path(tmp) / "model")
        clusters = {name: stack.enter_context(serve(model, 1, *flags, omp_threads=None))
                    for name, flags in settings.items()}
        for cluster in clusters.values():  # warm-up: a short request each
            cluster.client.generate([1, 5, 6], max_tokens=2, temperature=0)
        for round_ in range(args.rounds):
            order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
            working_set = [prompt() for _ in range(args.working_set)]  # fresh each round: no tier hit across rounds
            for name in order:
                client = clusters[name].client
                cold_ttft[name] += [ttft(client, p, args.max_tokens) for p in working_set]
                for _ in range(args.repeats):
                    repeat_ttft[name] += [ttft(client, p, args.max_tokens) for p in working_set]
            distinct = [prompt() for _ in range(args.no_reuse_requests)]
            for name in order:
                rates[name].append(throughput(clusters[name].client, distinct, args.concurrency, args.max_tokens))
        metrics = {name: {metric: cluster.metric(metric) for metric in (
            "tpserve:prefix_cache_hits_total", "tpserve:kv_offload_hits_total", "tpserve:kv_offload_stores_total",
            "tpserve:kv_offload_evictions_total")} for name, cluster in clusters.items()}
    report["repeat"] = {name: {"cold_ttft": summarize(cold_ttft[name]), "repeat_ttft": summarize(repeat_ttft[name])}
                        for name in settings}
    report["repeat"]["repeat_ttft_p50_off_over_on"] = round(
        report["repeat"]["off"]["repeat_ttft"]["p50_ms"] / report["repeat"]["on"]["repeat_ttft"]["p50_ms"], 2)
    report["no_reuse"] = {name: {"tokens_per_s_rounds": [round(r, 1) for r in rates[name]],
                                 "tokens_per_s_median": round(statistics.median(rates[name]), 1)} for name in settings}
    report["no_reuse"]["on_over_off"] = round(statistics.median(rates["on"]) / statistics.median(rates["off"]), 4)
    report["metrics"] = metrics
    with tempfile.TemporaryDirectory() as tmp:
        report["no_reuse_in_process"] = in_process_cost(long_model(Path(tmp) / "model"),
                                                        [prompt() for _ in range(args.no_reuse_requests)],
                                                        args.rounds, args.max_tokens, args.concurrency)
    report["load_average_at_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    if args.out is not None:
        save_report(args.out, "kv_host_tier.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
