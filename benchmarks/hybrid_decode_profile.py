"""Where a decode step's time goes on the rank, hybrid or dense (py-spy): the profile behind benchmarks/README.md's issue 44 section.

Serves one model of benchmarks/hybrid_checkpoints.py (one rank, one thread), starts ``--streams``
greedy streams of ``--prompt-len`` tokens decoding ``--max-tokens``, waits for their prefills, then
samples the rank with ``py-spy record -f raw`` for ``--seconds`` and prints the share of samples
per function (inclusive) and per source line of the state layers. py-spy sees Python frames only:
a torch op's time counts for the line that called it, which is what says which call to replace.

    .venv/bin/python benchmarks/hybrid_decode_profile.py --model hybrid    # py-spy: pip install py-spy
"""

from __future__ import annotations

import argparse
import collections
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import hybrid_checkpoints  # noqa: E402
from benchmarks.hybrid_decode import load  # noqa: E402
from tests.e2e.cluster import rank_pids, serve  # noqa: E402


def summarize(raw: Path, top: int) -> None:
    """Print the shares of py-spy's collapsed stacks: functions (inclusive), then the state layers' lines."""
    total, functions, lines = 0, collections.Counter(), collections.Counter()
    for row in raw.read_text().splitlines():
        stack, _, count = row.rpartition(" ")
        frames, n = stack.split(";"), int(count)
        total += n
        for name in {frame.split(" (")[0] for frame in frames}:
            functions[name] += n
        deepest = next((f for f in reversed(frames) if "gated_delta" in f or "causal_conv1d" in f), None)
        if deepest is not None:
            lines[deepest.split(" (", 1)[1].rstrip(")")] += n
    print(f"{total} samples")
    for title, counter in (("functions, inclusive", functions), ("state-layer lines", lines)):
        print(f"-- {title} --")
        for name, n in counter.most_common(top):
            print(f"{100 * n / total:5.1f} %  {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("hybrid", "dense"), default="hybrid")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--seconds", type=int, default=4, help="py-spy takes whole seconds")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    spec = hybrid_checkpoints.HYBRID if args.model == "hybrid" else hybrid_checkpoints.DENSE
    rng = random.Random(1)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(args.prompt_len - 1)] for _ in range(args.streams)]
    flags = ("--max-model-len", "2048", "--max-num-seqs", str(args.streams), "--kv-cache-memory-bytes", str(1 << 30),
             "--no-enable-prefix-caching")
    with tempfile.TemporaryDirectory() as tmp:
        hybrid_checkpoints.save(spec, Path(tmp) / args.model)
        with serve(Path(tmp) / args.model, 1, *flags, omp_threads=1) as cluster:
            load(cluster, prompts[:2], 8)  # warm-up
            worker = threading.Thread(target=lambda: print(load(cluster, prompts, args.max_tokens)))
            worker.start()
            time.sleep(2 + args.prompt_len * args.streams / 2500)  # past the prefills (a few thousand tokens/s)
            raw = Path(tmp) / "profile.txt"
            subprocess.run([py_spy, "record", "-p", str(rank_pids(cluster.process.pid)[0]), "-d", str(args.seconds),
                            "-r", "200", "-f", "raw", "-o", str(raw), "--nonblocking"], check=True,
                           capture_output=True)
            worker.join()
            summarize(raw, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
