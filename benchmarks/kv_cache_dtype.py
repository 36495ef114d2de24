"""``--kv-cache-dtype int8|fp8`` against the float cache: greedy agreement and decode-step time, in one run.

Agreement, on stories260k's goldens (5 prompts x 64 tokens) and the embedded model's float-cache greedy
tokens (4 prompts x 32), one-process tp 1 float32 runners (tests/worker/kv8_helpers.py):

* ``free_running``: each line generated greedily with the 8-bit cache, the share of the reference's
  tokens reproduced position by position up to the line's first difference (a divergence costs the
  rest of the line; the figure tests/worker/test_kv_cache_dtype.py asserts);
* ``free_running_positional``: the same lines, every position compared (chance matches after a
  divergence count);
* ``teacher_forced``: each position's greedy token given the reference prefix.

Decode step: the embedded model (d = 16: the compiled paged kernel reads the codes), ``--batch``
sequences of ``--context`` prompt tokens, then ``--steps`` decode steps, each runner's steps
interleaved with the others' so that a busy machine slows all alike; the median ms per step, of the
wall clock and of the process's CPU time (``--threads 1`` by default: on a shared host the CPU time
of one thread is the steadier figure, since other processes' load stretches the wall clock alone).

It runs against any source tree of tpserve with the same runner API (copy it into the tree to compare
a commit before a change with one after it):

    python benchmarks/kv_cache_dtype.py --label after --out /tmp/after.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests.paths import GOLDENS_PATH, STORIES_DIR  # noqa: E402
from tests.worker.kv8_helpers import GREEDY, eight_bit_runner, teacher_forced  # noqa: E402
from tpserve.embedded_model import default_model_dir  # noqa: E402
from tpserve.step import NewSequence, ScheduledChunk, StepPlan  # noqa: E402

EMBEDDED_PROMPTS = [[1, 9, 33, 7, 120], [1, 400, 12], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 77]]


def prefix_share(got: list[list[int]], want: list[list[int]]) -> float:
    """Tokens of ``want`` reproduced up to each line's first difference, over all of ``want``'s tokens."""
    kept = sum(next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want))
    return kept / sum(map(len, want))


def positional_share(got: list[list[int]], want: list[list[int]]) -> float:
    """Tokens of ``want`` equal to ``got``'s at the same position, over all of ``want``'s tokens."""
    return sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / sum(map(len, want))


def agreement(kv_cache_dtypes: list[str]) -> dict:
    """Per model and 8-bit dtype: the three agreement figures (module docstring)."""
    goldens = [json.loads(line) for line in GOLDENS_PATH.read_text().splitlines() if line.strip()]
    stories = ([g["prompt_token_ids"] for g in goldens], [g["completion_token_ids"] for g in goldens])
    embedded = (EMBEDDED_PROMPTS, teacher_forced(eight_bit_runner(default_model_dir(), "auto"), EMBEDDED_PROMPTS,
                                                 None, 32))
    out: dict = {}
    for name, model_dir, (prompts, want) in (("stories260k", STORIES_DIR, stories),
                                             ("embedded", default_model_dir(), embedded)):
        for kv_cache_dtype in kv_cache_dtypes:
            runner = eight_bit_runner(model_dir, kv_cache_dtype)
            free = teacher_forced(runner, prompts, None, len(want[0]))
            forced = teacher_forced(runner, prompts, want)
            out.setdefault(name, {})[kv_cache_dtype] = {
                "free_running": round(prefix_share(free, want), 4),
                "free_running_positional": round(positional_share(free, want), 4),
                "teacher_forced": round(positional_share(forced, want), 4),
                "tokens": sum(map(len, want)),
            }
    return out


def decode_steps(kv_cache_dtypes: list[str], batch: int, context: int, steps: int) -> dict:
    """Median ms (wall, CPU) of one decode step of ``batch`` sequences at ``context`` tokens, per cache dtype."""
    block_size = 16
    blocks_per_seq = -(-(context + steps + 1) // block_size)
    runners = {}
    for kv_cache_dtype in kv_cache_dtypes:
        runner = eight_bit_runner(default_model_dir(), kv_cache_dtype, num_blocks=batch * blocks_per_seq + 1)
        generator = torch.Generator().manual_seed(0)
        for s in range(batch):
            prompt = tuple(torch.randint(3, 500, (context,), generator=generator).tolist())
            table = tuple(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))
            runner.execute(StepPlan(s, (NewSequence(s, GREEDY),), (ScheduledChunk(s, prompt, 0, table),)))
        runners[kv_cache_dtype] = runner
    wall: dict[str, list[float]] = {k: [] for k in kv_cache_dtypes}
    cpu: dict[str, list[float]] = {k: [] for k in kv_cache_dtypes}
    for k in range(steps):
        for kv_cache_dtype, runner in runners.items():
            plan = StepPlan(batch + k, (), tuple(ScheduledChunk(s, (7,), context + k) for s in range(batch)))
            start, start_cpu = time.perf_counter(), time.process_time()
            runner.execute(plan)
            cpu[kv_cache_dtype].append((time.process_time() - start_cpu) * 1e3)
            wall[kv_cache_dtype].append((time.perf_counter() - start) * 1e3)
    return {"wall_ms": {k: round(statistics.median(v), 3) for k, v in wall.items()},
            "cpu_ms": {k: round(statistics.median(v), 3) for k, v in cpu.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="run")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dtypes = ["int8", "fp8"]
    torch.set_num_threads(args.threads)
    result = {"label": args.label, "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
              "torch": torch.__version__}
    if not args.skip_agreement:
        result["agreement"] = agreement(dtypes)
    result["decode_step_ms"] = {"batch": args.batch, "context": args.context, "steps": args.steps,
                                **decode_steps(["auto", *dtypes], args.batch, args.context, args.steps)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
