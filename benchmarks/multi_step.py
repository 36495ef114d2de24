"""Multi-step scheduling (``--num-scheduler-steps``) against a plan per step, served, in one run.

The 94.9M-parameter random Llama of benchmarks/peer_comparison.py, served at tp 1 (the rank's
threads by the server's own rule: every core) four ways at once: ``--quantization int4`` and
``int8``, each with a plan per step (``--num-scheduler-steps 1``, the default) and with
``--num-scheduler-steps K`` (``--steps``, 8 by default). Each round runs peer_comparison's
``single`` (32 prompt tokens, 128 out, greedy, ``ignore_eos``: the client's decode ms/token)
and ``batch16`` (16 x 128 / 128: output tokens/s) on every server back to back, the order
rotating between rounds; ratios are taken within a round and their medians reported, so a host
whose speed drifts slows both sides of a ratio alike.

Reported: multi-step's speed-up at one request and at 16 for each weight format, and int4's
speed over int8 at one request in each mode (issue 49's goal, 1.5x, measured through the server).
Every server's tokens are checked equal to the plan-per-step server's of the same format.

    python benchmarks/multi_step.py --rounds 5 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from benchmarks.peer_comparison import (  # noqa: E402
    _load, _stream, build_model, interleaved_round, machine_description, workloads)
from benchmarks.report import save_report  # noqa: E402
from tests.e2e.cluster import serve  # noqa: E402
from tpserve.v1 import generate_pb2_grpc  # noqa: E402


async def _tokens(target: str, reqs: list[tuple[list[int], int]]) -> list[list[int]]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        return [(await _stream(stub, prompt, n))["token_ids"] for prompt, n in reqs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="--num-scheduler-steps of the multi-step servers")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default="multi_step.json")
    args = parser.parse_args()
    report: dict = {"machine": machine_description(), "threads": os.cpu_count(), "seed": args.seed,
                    "steps": args.steps, "rounds": []}
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tpserve-multistep-")))
        model_dir = build_model(work / "model", args.seed)
        systems = {}
        for q in ("int4", "int8"):
            for steps in (1, args.steps):
                systems[f"{q}-{steps}"] = stack.enter_context(serve(
                    model_dir, 1, "--quantization", q, "--num-scheduler-steps", str(steps), omp_threads=None)).target
        check = workloads(args.seed, variant=args.rounds + 2)["batch16"][:4]
        tokens = {name: asyncio.run(_tokens(target, check)) for name, target in systems.items()}
        for q in ("int4", "int8"):
            if tokens[f"{q}-{args.steps}"] != tokens[f"{q}-1"]:
                raise SystemExit(f"{q}: --num-scheduler-steps {args.steps} gave other tokens than a plan per step")
        report["same_tokens"] = True
        names = list(systems)
        for i in range(args.rounds):
            r = interleaved_round(names, i, workloads(args.seed, variant=i + 1),
                                  lambda name, reqs: asyncio.run(_load(systems[name], reqs)))
            report["rounds"].append(r)
            print(f"round {i + 1}: " + ", ".join(f"{name} {r[name]['single']['tpot_median_ms']:.2f} ms "
                                                 f"{r[name]['batch16']['output_tokens_per_s']:.0f} tok/s"
                                                 for name in names), flush=True)
    k = args.steps

    def median(fn) -> tuple[float, list[float]]:
        values = [fn(r) for r in report["rounds"]]
        return statistics.median(values), values

    def single(r: dict, name: str) -> float:
        return r[name]["single"]["tpot_median_ms"]

    rows = {}
    for q in ("int4", "int8"):
        rows[f"{q}: {k} steps / 1, speed at 1 request"] = median(lambda r: single(r, f"{q}-1") / single(r, f"{q}-{k}"))
        rows[f"{q}: {k} steps / 1, tok/s at 16"] = median(
            lambda r: r[f"{q}-{k}"]["batch16"]["output_tokens_per_s"] / r[f"{q}-1"]["batch16"]["output_tokens_per_s"])
    for steps in (1, k):
        rows[f"int4 / int8 speed at 1 request, {steps} step(s) a plan"] = median(
            lambda r: single(r, f"int8-{steps}") / single(r, f"int4-{steps}"))
    for name in names:
        rows[f"{name}: ms/token at 1 request"] = median(lambda r: single(r, name))
    report["ratios"] = {what: {"median": round(x, 3), "rounds": [round(v, 3) for v in values]}
                        for what, (x, values) in rows.items()}
    for what, (x, values) in rows.items():
        print(f"{what}: {x:.2f}  rounds {[round(v, 2) for v in values]}")
    if args.out:
        save_report(args.out, args.name, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
