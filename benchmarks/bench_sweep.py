"""A request-rate sweep of ``tpserve bench`` against a server started here, at each tensor-parallel degree.

For each degree it starts ``tpserve serve`` (the launcher the tests use: loopback, one
CPU thread per rank), runs ``tpserve bench --sweep-request-rate`` against it with fixed
output lengths (``--ignore-eos``), and writes ``bench_sweep_tp{N}.json`` and ``.png`` to
``--out``. The plot's left panel is output throughput against p99 TPOT.

    python benchmarks/bench_sweep.py --model ../shared/models/stories260k \
        --tensor-parallel-size 1 2 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.cluster import serve  # noqa: E402  (the same launcher the tests use)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rates", default="1,2,4,8,16,32,inf", help="--sweep-request-rate of tpserve bench")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON and PNG files")
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    for tp in args.tensor_parallel_size:
        with serve(args.model, tp) as cluster:
            stem = args.out / f"bench_sweep_tp{tp}"
            subprocess.run([sys.executable, "-m", "launch.cli", "bench", "--target", cluster.target,
                            "--dataset", "random", "--num-prompts", str(args.num_prompts),
                            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                            "--ignore-eos", "--num-warmups", "4", "--sweep-request-rate", args.rates,
                            "--goodput", "ttft:500", "tpot:50", "--disable-tqdm",
                            "--result-file", f"{stem}.json", "--plot", f"{stem}.png"], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
