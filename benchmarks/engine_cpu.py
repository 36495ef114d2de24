"""The engine loop's own CPU per output token, without gRPC (docs/design/request-path.md, "Where a streamed token's coordinator CPU goes").

benchmarks/coordinator_cpu.py measures the whole coordinator process, where gRPC's per
message and per call costs (benchmarks/grpc_stream_floor.py) dominate and a loaded host's
noise hides changes to our own Python. This runs ``coordinator.engine.Engine`` in one
process with a stand-in worker group that answers every plan at once (the plan still
encoded with ``plan_to_pb``; sampled tokens taken from a fixed English text, so the
detokenizer sees real words), ``--streams`` concurrent requests of ``--max-tokens`` greedy
tokens each, read through ``Engine.generate`` as the gRPC handler reads them. It measures
``time.process_time()`` over the batch, after a ``gc.freeze()`` as the server does:

    engine CPU per output token = process CPU time / output tokens

which covers scheduling, plan encoding, update, detokenization, stop strings, the output
collector and the handler's wake-up: everything per token that is ours. With
``--baseline DIR`` the same measurement runs on another checkout (its code imported
first), alternating rounds. One command, bounded (well under a minute)::

    .venv/bin/python benchmarks/engine_cpu.py --baseline /tmp/base --out benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with "
        "her dog Max. One day, they went to the park and saw a big red ball.")


def measure(num_streams: int, max_tokens: int, stream_interval: int) -> float:
    """Engine CPU seconds per output token for one batch of ``num_streams`` streams (after a warm-up)."""
    from coordinator.block_allocator import BlockAllocator
    from coordinator.engine import Engine
    from coordinator.metrics import Metrics
    from coordinator.scheduler import Scheduler
    from coordinator.tokenizer import Tokenizer
    from coordinator.validation import validate_request
    from tpserve.embedded_model import default_model_dir
    from tpserve.step import StepResult
    from tpserve.step_pb import plan_to_pb
    from tpserve.v1 import generate_pb2 as pb

    tokenizer = Tokenizer.from_pretrained(default_model_dir())
    text_ids = tokenizer.encode(TEXT)

    class AnsweringGroup:
        """Answers each plan at once: chunk c samples the text's token at (its position * 7 + seq id)."""

        async def submit(self, plan):
            plan_to_pb(plan).SerializeToString()  # the wire encoding the real group does
            answer = asyncio.get_running_loop().create_future()
            answer.set_result(StepResult(plan.step_id, tuple(
                text_ids[(c.start_position * 7 + c.seq_id) % len(text_ids)] for c in plan.scheduled if c.sample)))
            return answer

    async def run() -> float:
        scheduler = Scheduler(BlockAllocator(8192, 16), max_num_seqs=max(num_streams, 4),
                              max_num_batched_tokens=max(2048, 8 * num_streams))
        extra = {} if stream_interval == 1 else {"stream_interval": stream_interval}
        engine = Engine(scheduler, AnsweringGroup(), tokenizer, 2048, 4096, Metrics(), **extra)
        loop_task = asyncio.create_task(engine.run())
        request = pb.GenerateRequest(text="Once upon a time", sampling_params=pb.SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True))
        params = validate_request(request, tokenizer, tokenizer.vocab_size, 2048)

        async def one() -> int:
            return sum([len(out.token_ids) async for out in engine.generate(params)])

        await asyncio.gather(*(one() for _ in range(4)))  # warm-up
        gc.collect()
        gc.freeze()
        started = time.process_time()
        num_tokens = sum(await asyncio.gather(*(one() for _ in range(num_streams))))
        cpu = time.process_time() - started
        loop_task.cancel()
        assert num_tokens == num_streams * max_tokens, num_tokens
        return cpu / num_tokens

    return asyncio.run(run())


def in_checkout(checkout: Path, num_streams: int, max_tokens: int, stream_interval: int) -> float:
    """:func:`measure` in a fresh process that imports ``checkout``'s code."""
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, __file__, "--one", str(num_streams), str(max_tokens), str(stream_interval)],
                         cwd=checkout, env=env, check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, help="another tpserve checkout to measure in the same rounds")
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--stream-interval", type=int, default=1, help="this checkout's interval (baseline: 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write engine_cpu.json here")
    parser.add_argument("--one", nargs=3, type=int, help=argparse.SUPPRESS)  # internal: one measurement
    args = parser.parse_args()
    if args.one:
        print(measure(*args.one))
        return
    root = Path(__file__).resolve().parents[1]
    checkouts = {"candidate": root} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    raw: dict[str, dict[int, list[float]]] = {name: {n: [] for n in args.streams} for name in checkouts}
    for n in args.streams:
        for round_index in range(args.rounds):
            for name in (list(checkouts) if round_index % 2 == 0 else list(reversed(checkouts))):
                interval = args.stream_interval if name == "candidate" else 1
                raw[name][n].append(in_checkout(checkouts[name], n, args.max_tokens, interval) * 1e6)
        row = {name: round(statistics.median(raw[name][n]), 1) for name in checkouts}
        ratio = f", candidate / baseline {row['candidate'] / row['baseline']:.2f}" if "baseline" in row else ""
        print(f"{n} streams: engine CPU per token (us, median of {args.rounds}) {row}{ratio}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"benchmark": "engine_cpu", "max_tokens": args.max_tokens, "stream_interval": args.stream_interval,
                  "rounds": args.rounds, "load_average": os.getloadavg(), "num_cpus": os.cpu_count(),
                  "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                  "us_per_token": {name: {str(n): v for n, v in by_n.items()} for name, by_n in raw.items()}}
        path = args.out / "engine_cpu.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(path)


if __name__ == "__main__":
    main()
