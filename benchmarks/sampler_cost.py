"""The sampler's share of a decode step at 64 rows (docs/design/sampling.md, "Sampling controls"): pack the rows' parameters, apply the
logits processors, pick the tokens. One command, bounded (about 10 s):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sampler_cost.py [--rows 64] [--vocab 512] [--repeats 300]

Prints the median CPU microseconds (the thread's) per call for a greedy batch, a mixed batch (half greedy, half
sampled with temperature 0.8, top_k 40, top_p 0.9; every fourth sampled row with min_p 0.05 and a
repetition penalty over a 100-token history) and a default batch (every row the default parameters,
temperature 1 and no filter, a seed each: benchmarks/bare_step.py's sampling). Runs on whichever sampler the checkout has (the
old ``worker.logits_controls`` or ``worker.logits_processors``), so a before / after is two runs
of this script in two checkouts, interleaved (``--compare OTHER_CHECKOUT``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _batches(rows: int):
    from tpserve.step import SamplingParams

    greedy = [SamplingParams(temperature=0.0) for _ in range(rows)]
    mixed = [SamplingParams(temperature=0.0) if i % 2 == 0 else
             SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=i,
                            **(dict(min_p=0.05, repetition_penalty=1.2) if i % 8 == 1 else {}))
             for i in range(rows)]
    default = [SamplingParams(seed=i) for i in range(rows)]  # temperature 1, no filter: every row races
    return {"greedy": greedy, "mixed": mixed, "default": default}


def _sampler(params, positions, histories):
    """One call of the checkout's sampler: pack, apply the processors, sample. Returns the tokens."""
    from tpserve.step import ScheduledChunk

    chunks = [ScheduledChunk(i, (h[-1],), pos - 1) for i, (h, pos) in enumerate(zip(histories, positions))]

    class State:
        def __init__(self, sampling, history):
            self.sampling, self.num_prompt_tokens, self.history, self.grammar_state = sampling, 50, history, None

    states = [State(p, h if p.uses_token_history else None) for p, h in zip(params, histories)]
    try:
        from worker.logits_processors import with_processors
        from worker.sampler import SamplingTensors, sample_tensors

        def run(logits):
            tensors = SamplingTensors.from_params(params, positions, "cpu")
            return sample_tensors(logits, with_processors(tensors, chunks, states, "cpu"))
    except ImportError:
        from worker.logits_controls import with_logits_controls
        from worker.sampler import SamplingTensors, sample_tensors

        def run(logits):
            tensors = SamplingTensors.from_params(params, positions, "cpu")
            return sample_tensors(logits, with_logits_controls(tensors, chunks, states, "cpu"))
    return run


def measure(rows: int, vocab: int, repeats: int) -> dict[str, float]:
    import torch

    torch.manual_seed(0)
    logits = torch.randn(rows, vocab) * 3
    histories = [torch.randint(0, vocab, (100,)).tolist() for _ in range(rows)]
    positions = [100] * rows
    out = {}
    for name, params in _batches(rows).items():
        run = _sampler(params, positions, histories)
        run(logits)
        times = []
        for _ in range(repeats):  # the thread's CPU time: less noise from other processes than the wall clock
            start = time.thread_time()
            run(logits)
            times.append(time.thread_time() - start)
        out[name] = statistics.median(times) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024, help="the embedded model's vocabulary")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--compare", help="another checkout (its .venv, which imports its code): 3 rounds, alternating")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--root", help="import the sampler from this checkout (set by --compare)")
    args = parser.parse_args()
    if args.root:
        sys.path.insert(0, args.root)
    if args.compare:
        import json

        cmd = [str(Path(__file__).resolve()), "--rows", str(args.rows), "--vocab", str(args.vocab),
               "--repeats", str(args.repeats), "--json"]
        for round_ in range(3):
            for label, root in (("other", Path(args.compare).resolve()), ("this", ROOT)):
                python = root / ".venv/bin/python"  # a bare worktree of another commit: this interpreter
                out = subprocess.run([str(python if python.exists() else sys.executable), *cmd, "--root", str(root)],
                                     cwd=root,
                                     capture_output=True, text=True, check=True,
                                     env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
                result = json.loads(out.stdout)
                print(f"round {round_} {label:5s}: " + ", ".join(f"{k} {v:.0f} us" for k, v in result.items()))
        return
    result = measure(args.rows, args.vocab, args.repeats)
    if args.json:
        import json

        print(json.dumps(result))
    else:
        for name, us in result.items():
            print(f"{name}: {us:.0f} us per call at {args.rows} rows, vocab {args.vocab}")


if __name__ == "__main__":
    main()
