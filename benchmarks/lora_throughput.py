"""Multi-LoRA decode throughput at 16 streams: what ``--enable-lora`` costs the base model, and what 8 adapters cost.

Two servers of the same model, both up at once and measured in turn (``--repeats`` passes,
alternating which goes first; medians): **off** (no LoRA) and **lora** (``--enable-lora
--max-loras 8 --max-lora-rank R --lora-modules`` with 8 seeded ``peft`` adapters of rank R on
all seven projections, built by tests/worker/lora_checkpoints.py). Each pass sends
``--num-streams`` greedy ``ignore_eos`` requests at once (seeded random prompts) and reports
output tok/s for

* ``base_off``: the base model on the server without LoRA;
* ``base_lora``: the base model (no ``lora_name``) on the LoRA server: no step has an adapter
  row, so each step runs the compiled decode step with no LoRA argument (worker/layers/decode_block.py);
* ``mixed_lora``: the same requests spread round-robin over the 8 adapters: every step runs,
  per projection, the base GEMM once and one ``lora_add_`` over every adapter row (worker/kernels/cpu_lora.cpp).

Ratios: ``enable_lora_overhead`` = base_lora / base_off (1.0: free), ``mixed_vs_base`` =
mixed_lora / base_lora. Not a timed test: a recorded run (benchmarks/results/lora_throughput_*.json).

    python benchmarks/lora_throughput.py --repeats 20 --out benchmarks/results   # the embedded model
    python benchmarks/lora_throughput.py --repeats 1 --max-tokens 16          # runs?
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import save_report  # noqa: E402
from tests.e2e.cluster import serve  # noqa: E402  (the same launcher the tests use)
from tests.worker.lora_checkpoints import ALL_TARGETS, AdapterSpec, save_adapter  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "tpserve" / "default_model"
NUM_ADAPTERS = 8


def one_pass(client, requests: list[dict]) -> float:
    """Output tok/s of ``requests`` sent all at once."""
    with ThreadPoolExecutor(len(requests)) as pool:
        start = time.perf_counter()
        results = list(pool.map(lambda r: client.generate(**r), requests))
        elapsed = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint directory (a Llama-layout family)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--num-streams", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16, help="every adapter's r (and --max-lora-rank)")
    parser.add_argument("--repeats", type=int, default=4, help="passes of each workload; medians")
    parser.add_argument("--omp-threads", type=int, default=None,
                        help="OMP_NUM_THREADS of every rank (default: the rank's own, one per core); 1 keeps a "
                             "loaded shared host from stalling the ranks' thread teams")
    parser.add_argument("--out", type=Path, default=None, help="directory for the JSON result")
    args = parser.parse_args()
    config = json.loads((args.model / "config.json").read_text())
    vocab = config["vocab_size"]
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, vocab) for _ in range(args.prompt_len - 1)] for _ in range(args.num_streams)]
    base = [dict(prompt=p, max_tokens=args.max_tokens, temperature=0, ignore_eos=True) for p in prompts]
    names = [f"lora{i}" for i in range(NUM_ADAPTERS)]
    mixed = [dict(r, lora_name=names[i % NUM_ADAPTERS]) for i, r in enumerate(base)]
    adapter_root = Path(tempfile.mkdtemp(prefix="tpserve-lora-bench-"))
    for i, name in enumerate(names):
        save_adapter(args.model, AdapterSpec(name, args.rank, 2.0 * args.rank, ALL_TARGETS, seed=100 + i),
                     adapter_root / name)
    lora_flags = ["--enable-lora", "--max-loras", str(NUM_ADAPTERS), "--max-lora-rank", str(args.rank),
                  "--lora-modules", *(f"{name}={adapter_root / name}" for name in names)]
    report: dict = {"benchmark": "lora_throughput", "model": args.model.name,
                    "tensor_parallel_size": args.tensor_parallel_size, "num_streams": args.num_streams,
                    "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "adapter_rank": args.rank,
                    "num_adapters": NUM_ADAPTERS, "repeats": args.repeats, "omp_threads": args.omp_threads,
                    "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_average_at_start": os.getloadavg(),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    runs: dict[str, list[float]] = {"base_off": [], "base_lora": [], "mixed_lora": []}
    with contextlib.ExitStack() as stack:  # both servers up at once, measured in turn
        off = stack.enter_context(serve(args.model, args.tensor_parallel_size, omp_threads=args.omp_threads))
        lora = stack.enter_context(serve(args.model, args.tensor_parallel_size, *lora_flags,
                                         omp_threads=args.omp_threads))
        passes = [("base_off", off.client, base), ("base_lora", lora.client, base), ("mixed_lora", lora.client, mixed)]
        for _, client, requests in passes:
            one_pass(client, requests[:2])  # warm-up
        for r in range(args.repeats):  # each workload goes first as often as last: order biases cancel
            for name, client, requests in passes if r % 2 == 0 else passes[::-1]:
                runs[name].append(one_pass(client, requests))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    report.update(
        tokens_per_s={name: round(value, 1) for name, value in medians.items()},
        tokens_per_s_runs={name: [round(v, 1) for v in values] for name, values in runs.items()},
        ratios={"enable_lora_overhead": round(medians["base_lora"] / medians["base_off"], 3),
                "mixed_vs_base": round(medians["mixed_lora"] / medians["base_lora"], 3)},
        load_average_at_end=os.getloadavg())
    print(json.dumps(report, indent=2))
    if args.out is not None:
        save_report(args.out, f"lora_throughput_{args.model.name}_tp{args.tensor_parallel_size}.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
