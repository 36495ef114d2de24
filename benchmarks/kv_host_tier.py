"""The prefix cache's host tier (issue 45), side by side in one run: tier off against tier on.

1. **Repeated long prompts** (``repeat``): W distinct prompts of 1,500 tokens, each sent R+1 times
   in turn (one at a time, greedy, streamed), through a device pool that holds one of them (128
   blocks of 16 = 2,048 tokens), so every repeat finds its prompt evicted. Off: each repeat computes
   the prompt again. On (``--num-cpu-blocks-override``, ten times the pool): each repeat copies its
   93 full blocks back from the host tier and computes the last block. Reports TTFT of the repeats.
2. **0 % reuse** (``no_reuse``): N distinct 1,500-token prompts, in batches of C sent at once,
   each batch to one server then the other (alternating who goes first), through the same pool:
   every admission evicts, so the tier-on server copies every evicted block out and never reads
   one back: the tier's whole cost. Reports prompt + output tokens per second.

Both servers are up at once and the settings alternate, round after round (``--rounds``), so that
the load of this shared host falls on both alike; each figure is the median over the rounds.

3. **0 % reuse in one process** (``no_reuse_in_process``): the same load through a scheduler and
   a ``ModelRunner`` per setting in this process, in lockstep (a step of one, the same step of the
   other), timing ``schedule`` + ``execute`` + ``update``, with the host-tier copies also timed on
   their own: the tier's cost with none of the serving path's noise (a served run's throughput
   moves 10-30 % between rounds on this host, more under load).

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


def timed_batch(client, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """Seconds to serve ``prompts`` all at once, and their prompt + output tokens."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: client.generate(p, max_tokens=max_tokens, temperature=0, ignore_eos=True),
                                prompts))
    return time.perf_counter() - start, sum(r.usage.prompt_tokens + r.usage.completion_tokens for r in results)


def shifted(plan, seq_offset: int, block_offset: int):
    """``plan`` with every sequence id and device block id moved up (two schedulers sharing one runner)."""
    from dataclasses import replace

    from tpserve.step import ScheduledChunk

    return replace(
        plan, new_seqs=tuple(replace(new, seq_id=new.seq_id + seq_offset) for new in plan.new_seqs),
        scheduled=tuple(ScheduledChunk(c.seq_id + seq_offset, c.token_ids, c.start_position,
                                       tuple(b + block_offset for b in c.new_block_ids), c.sample)
                        for c in plan.scheduled),
        finished_seq_ids=tuple(seq_id + seq_offset for seq_id in plan.finished_seq_ids),
        kv_swap_out=tuple((b + block_offset, slot) for b, slot in plan.kv_swap_out),
        kv_swap_in=tuple((slot, b + block_offset) for slot, b in plan.kv_swap_in))


def in_process_cost(model: Path, prompts: list[list[int]], rounds: int, max_tokens: int,
                    concurrency: int) -> dict:
    """Tier off and on in lockstep through one runner: the steps' seconds (schedule, execute, update), and
    (on) the host-tier copies' seconds within them.

    One ``ModelRunner`` serves both: the off scheduler's sequences and blocks are its first half, the
    on scheduler's (ids moved up) its second half and its host slots; two runners would not do, the
    one built second ran 10 % slower on this host with no tier at all.
    """
    import torch

    from coordinator.block_allocator import BlockAllocator
    from coordinator.kv_host_tier import HostTier
    from coordinator.scheduler import Scheduler
    from coordinator.sequence import Sequence, StopParams
    from tpserve.step import SamplingParams
    from worker.model_runner import ModelRunner
    from worker.parallel_state import ParallelContext

    runner = ModelRunner(model, ParallelContext.single(), torch.float32, block_size=BLOCK_SIZE)
    runner.init_kv_cache(2 * POOL_BLOCKS, num_host_blocks=TIER_BLOCKS)
    tier = runner.host_tier
    assert tier is not None
    copy_s = [0.0]
    copy = tier.copy

    def timed_copy(*args) -> None:
        start = time.perf_counter()
        copy(*args)
        copy_s[0] += time.perf_counter() - start

    tier.copy = timed_copy  # type: ignore[method-assign]
    offsets = {"off": (0, 0), "on": (1_000_000, POOL_BLOCKS)}
    step_s: dict[str, list[float]] = {"off": [], "on": []}
    copies: list[float] = []
    num_stores = 0
    for round_ in range(-1, rounds):  # round -1: a warm-up, not recorded
        schedulers = {}
        for name in ("off", "on"):
            host = HostTier(TIER_BLOCKS, BLOCK_SIZE) if name == "on" else None
            schedulers[name] = Scheduler(BlockAllocator(POOL_BLOCKS, BLOCK_SIZE), concurrency, 2048,
                                         enable_prefix_caching=True, host_tier=host)
            for i, p in enumerate(prompts):
                schedulers[name].add(Sequence(i, list(p), SamplingParams(temperature=0.0),
                                              StopParams(max_tokens, frozenset()), 2048))
        copy_s[0] = 0.0
        totals = {"off": 0.0, "on": 0.0}
        step = 0
        # Lockstep: a step of one, then the same step of the other, who goes first alternating, so that
        # the host's load at any moment falls on both alike.
        with torch.inference_mode():
            while any(sch.has_work() for sch in schedulers.values()):
                for name in (("off", "on") if step % 2 == 0 else ("on", "off")):
                    scheduler = schedulers[name]
                    if not scheduler.has_work():
                        continue
                    start = time.perf_counter()  # the coordinator's side included: the tier's bookkeeping
                    plan = scheduler.schedule()
                    scheduler.update(plan, runner.execute(shifted(plan, *offsets[name])))
                    totals[name] += time.perf_counter() - start
                step += 1
        if round_ < 0:
            continue
        for name in totals:
            step_s[name].append(totals[name])
        host = schedulers["on"].kv_cache.host_tier
        assert host is not None and host.num_hits == 0  # 0 % reuse: nothing is read back
        copies.append(copy_s[0])
        num_stores = host.num_stores
    median_on = statistics.median(step_s["on"])
    return {"step_seconds_rounds": {k: [round(v, 3) for v in vals] for k, vals in step_s.items()},
            "step_seconds_median": {k: round(statistics.median(v), 3) for k, v in step_s.items()},
            "on_over_off_step_seconds": round(median_on / statistics.median(step_s["off"]), 4),
            "copy_seconds_rounds": [round(c, 4) for c in copies],
            "copy_share_of_step_seconds": round(statistics.median(copies) / median_on, 4),
            "blocks_copied_to_host_per_round": num_stores,
            "bytes_per_block": runner.kv_layout.bytes_per_block}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=1500)
    parser.add_argument("--working-set", type=int, default=3, help="distinct prompts repeated (W)")
    parser.add_argument("--repeats", type=int, default=2, help="repeats of each prompt per round (R)")
    parser.add_argument("--no-reuse-requests", type=int, default=16, help="distinct prompts of the 0 %% reuse load")
    parser.add_argument("--in-process-requests", type=int, default=8, help="distinct prompts of the in-process load")
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
            # 0 % reuse: batches of `concurrency` fresh prompts, each batch on one server then the other.
            elapsed = {"off": 0.0, "on": 0.0}
            tokens = {"off": 0, "on": 0}
            for batch_index in range(-(-args.no_reuse_requests // args.concurrency)):
                batch = [prompt() for _ in range(args.concurrency)]
                for name in (order if batch_index % 2 == 0 else order[::-1]):
                    seconds, num_tokens = timed_batch(clusters[name].client, batch, args.max_tokens)
                    elapsed[name] += seconds
                    tokens[name] += num_tokens
            for name in order:
                rates[name].append(tokens[name] / elapsed[name])
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
                                                        [prompt() for _ in range(args.in_process_requests)],
                                                        args.rounds, args.max_tokens, args.concurrency)
    report["load_average_at_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    if args.out is not None:
        save_report(args.out, "kv_host_tier.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
