"""LoRA adapter load time into a slot: from host memory (``--max-cpu-loras``) against from disk.

One rank (tp 1) of ``--model`` with ``--enable-lora --max-loras 2`` and ``--num-adapters`` seeded
``peft`` adapters of rank R on all seven projections (tests/worker/lora_checkpoints.py). Each
round loads every adapter into slot 1 twice, interleaved: first with the host cache emptied
(**disk**: the config parsed and checked, the safetensors opened, every tensor read, scaled and
split for the rank; the file is in the page cache, as on a server that read it before), then
again (**host**: the rank's copy in host memory copied into the slot). Medians over rounds and
adapters, and their ratio. The same ``LoRAAdapters.load`` a ``LoadLoRAAdapter`` RPC runs on
every rank (worker/lora_adapters.py). Not a timed test: a recorded run
(benchmarks/results/lora_load_time_*.json).

    python benchmarks/lora_load_time.py --out benchmarks/results      # the embedded model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.report import save_report  # noqa: E402
from tests.worker.lora_checkpoints import ALL_TARGETS, AdapterSpec, save_adapter  # noqa: E402
from worker.lora_settings import LoRASettings  # noqa: E402
from worker.model_runner import ModelRunner  # noqa: E402
from worker.parallel_state import ParallelContext  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "tpserve" / "default_model"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint directory (a Llama-layout family)")
    parser.add_argument("--rank", type=int, default=16, help="every adapter's r (and --max-lora-rank)")
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None, help="directory for the JSON result")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="tpserve-lora-load-"))
    paths = [root / f"lora{i}" for i in range(args.num_adapters)]
    for i, path in enumerate(paths):
        save_adapter(args.model, AdapterSpec(path.name, args.rank, 2.0 * args.rank, ALL_TARGETS, seed=200 + i), path)
    runner = ModelRunner(args.model, ParallelContext.single(), torch.float32, 16,
                         lora=LoRASettings(2, args.rank, max_cpu_loras=args.num_adapters))
    adapters = runner.lora
    assert adapters is not None
    times: dict[str, list[float]] = {"disk": [], "host": []}
    for path in paths:  # warm-up: the page cache and the allocator
        adapters.host_cache.clear()
        adapters.load(1, path)
    for _ in range(args.rounds):
        for path in paths:
            adapters.host_cache.clear()
            start = time.perf_counter()
            assert adapters.load(1, path) is False
            times["disk"].append(time.perf_counter() - start)
            start = time.perf_counter()
            assert adapters.load(1, path) is True
            times["host"].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    size = sum((path / "adapter_model.safetensors").stat().st_size for path in paths) / len(paths)
    report = {
        "benchmark": "lora_load_time", "model": args.model.name, "tensor_parallel_size": 1,
        "adapter_rank": args.rank, "targets": list(ALL_TARGETS), "adapter_file_bytes": int(size),
        "num_adapters": args.num_adapters, "rounds": args.rounds,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_ms": {name: round(value * 1e3, 3) for name, value in medians.items()},
        "load_ms_quartiles": {name: [round(q * 1e3, 3) for q in statistics.quantiles(values, n=4)]
                              for name, values in times.items()},
        "ratios": {"host_vs_disk": round(medians["host"] / medians["disk"], 3)},
    }
    print(json.dumps(report, indent=2))
    if args.out is not None:
        save_report(args.out, f"lora_load_time_{args.model.name}_tp1.json", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
