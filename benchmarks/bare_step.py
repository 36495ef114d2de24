"""The bare decode step: ``ModelRunner.execute`` of a pure decode plan, in one process, no server.

What a rank spends per step besides the coordinator: applying the plan, building the
step's inputs and attention metadata, the forward pass, the logits and sampling. On
the embedded model (tpserve/default_model, 1.1M parameters) the forward itself is
well under a millisecond, so this measures the step's fixed cost (docs/design/scheduling.md, "The engine loop").

Plans are built as the scheduler builds them: every sequence first prefilled in one
step (its whole prompt, with the blocks it needs), then each decode step feeds every
sequence its last sampled token at its next position, with a new block id exactly
when that position starts a block. Sampling: the default ``SamplingParams`` (temperature
1, top-k/top-p off), a distinct seed per sequence.

One command, bounded run time::

    .venv/bin/python benchmarks/bare_step.py                     # this tree
    .venv/bin/python benchmarks/bare_step.py --baseline /tmp/main # interleaved with another checkout
    .venv/bin/python benchmarks/bare_step.py --model DIR --threads 2 --sizes 1,4,16  # another checkpoint

With ``--baseline PATH`` each round runs the measurement once in a subprocess on
``PATH``'s code and once on this tree's, alternately, so machine noise falls on both;
the report gives each side's median over rounds and the ratio.

Importable: :func:`measure_bare_step` (benchmarks/step_overhead.py reuses it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class DecodeSteps:
    """A runner with ``num_seqs`` prefilled sequences and the decode plans that follow, one per :meth:`step`.

    tp 1, float32, CPU; ``model_dir`` None: the embedded model. ``max_steps`` sizes the block tables.
    """

    def __init__(self, num_seqs: int, *, max_steps: int, prompt_len: int = 24, block_size: int = 16,
                 model_dir: str | None = None) -> None:
        import torch

        from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan
        from worker.model_runner import ModelRunner
        from worker.parallel_state import ParallelContext

        self._chunk, self._plan = ScheduledChunk, StepPlan
        blocks_per_seq = -(-(prompt_len + max_steps + 1) // block_size)
        self.runner = ModelRunner(model_dir or str(REPO / "tpserve" / "default_model"), ParallelContext.single(),
                                  torch.float32, block_size=block_size)
        self.runner.init_kv_cache(num_blocks=num_seqs * blocks_per_seq)
        vocab = self.runner.config.vocab_size
        self.tables = [list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq)) for s in range(num_seqs)]
        prompt_blocks = -(-prompt_len // block_size)
        new = tuple(NewSequence(s, SamplingParams(seed=1000 + s), num_prompt_tokens=prompt_len)
                    for s in range(num_seqs))
        prefill = tuple(ScheduledChunk(s, tuple((7 * s + 3 * j) % vocab for j in range(prompt_len)), 0,
                                       tuple(self.tables[s][:prompt_blocks])) for s in range(num_seqs))
        self.last = list(self.runner.execute(StepPlan(0, new, prefill)).sampled_token_ids)
        self.num_seqs, self.block_size, self.position, self.step_id = num_seqs, block_size, prompt_len, 0

    def next_plan(self):
        """The next decode plan (as the scheduler builds it: a new block id when a position starts a block)."""
        position, size = self.position, self.block_size
        new_blocks = position % size == 0
        chunks = tuple(self._chunk(s, (self.last[s],), position,
                                   (self.tables[s][position // size],) if new_blocks else ())
                       for s in range(self.num_seqs))
        self.step_id += 1
        self.position += 1
        return self._plan(self.step_id, scheduled=chunks)

    def step(self) -> tuple[float, float]:
        """Run the next decode step; its ``execute`` wall time and this thread's CPU time, in seconds.

        The CPU time (``time.thread_time``; with one intra-op thread all the step's work is on this
        thread) is what a busy machine disturbs least: preemption by other processes does not count.
        """
        plan = self.next_plan()
        start, start_cpu = time.perf_counter(), time.thread_time()
        result = self.runner.execute(plan)
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
        self.last = list(result.sampled_token_ids)
        return elapsed, cpu


def measure_bare_step(num_seqs: int, *, num_steps: int = 40, warmup_steps: int = 5, cpu: bool = False,
                      **kwargs) -> float:
    """Median time of one decode ``ModelRunner.execute``, in seconds, at ``num_seqs`` sequences.

    Wall time, or with ``cpu`` the thread's CPU time. ``kwargs`` go to :class:`DecodeSteps`
    (prompt_len, block_size, model_dir).
    """
    steps = DecodeSteps(num_seqs, max_steps=warmup_steps + num_steps, **kwargs)
    times = [steps.step() for _ in range(warmup_steps + num_steps)]
    return statistics.median(t[cpu] for t in times[warmup_steps:])


def _measure_all(sizes: list[int], num_steps: int, model_dir: str | None = None) -> dict[str, list[float]]:
    """Per size: [median wall seconds, median CPU seconds] (one set of steps, both clocks)."""
    out = {}
    for n in sizes:
        steps = DecodeSteps(n, max_steps=5 + num_steps, model_dir=model_dir)
        times = [steps.step() for _ in range(5 + num_steps)][5:]
        out[str(n)] = [statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)]
    return out


def _run_tree(tree: Path, sizes: list[int], num_steps: int, threads: int,
              model_dir: str | None = None) -> dict[str, list[float]]:
    """One measurement of every size on ``tree``'s code, in a fresh process."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(tree))
    code = (f"import sys, json; sys.path.insert(0, {str(tree)!r}); import torch; torch.set_num_threads({threads}); "
            f"sys.path.insert(0, {str(REPO / 'benchmarks')!r}); import bare_step; "
            f"print(json.dumps(bare_step._measure_all({sizes!r}, {num_steps}, {model_dir!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,16,64,256", help="comma-separated numbers of sequences")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per size and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each a fresh process per tree)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout to interleave with")
    parser.add_argument("--model", default=None,
                        help="a checkpoint directory (default: the embedded model), e.g. peer_comparison's 95M model")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    trees = {"candidate": REPO} if args.baseline is None else {"baseline": args.baseline.resolve(), "candidate": REPO}
    runs: dict[str, list[dict[str, list[float]]]] = {name: [] for name in trees}
    machine = _machine()
    for _ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(_run_tree(tree, sizes, args.steps, args.threads, args.model))
    medians = {name: {n: [statistics.median(r[str(n)][clock] for r in rounds) for clock in (0, 1)] for n in sizes}
               for name, rounds in runs.items()}
    print(f"bare decode step, ModelRunner.execute, {args.model or 'embedded model'}, tp 1, float32, "
          f"{args.threads} thread(s), "
          f"median of {args.steps} steps per round, median of {args.rounds} rounds; wall ms (CPU ms)")
    header = "| sequences | " + " | ".join(f"{name} ms" for name in trees) + \
        (" | ratio wall (CPU) |" if len(trees) > 1 else " |")
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for n in sizes:
        cells = [f"{medians[name][n][0] * 1e3:.2f} ({medians[name][n][1] * 1e3:.2f})" for name in trees]
        ratio = ""
        if len(trees) > 1:
            base, cand = medians["baseline"][n], medians["candidate"][n]
            ratio = f" | {base[0] / cand[0]:.2f}x ({base[1] / cand[1]:.2f}x)"
        print(f"| {n} | " + " | ".join(cells) + ratio + " |")
    if args.json is not None:
        args.json.write_text(json.dumps({"rounds_wall_cpu_s": runs, "medians_wall_cpu_s": medians,
                                         "threads": args.threads, "steps": args.steps, "model": args.model,
                                         "trees": {name: str(tree) for name, tree in trees.items()},
                                         "machine": dict(machine, load_average_end=os.getloadavg())},
                                        indent=1) + "\n")


def _machine() -> dict:
    """What the numbers were measured on: CPU, cores, torch, the time (UTC) and the load when it started."""
    import platform

    import torch

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": model, "cores": os.cpu_count(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "load_average_start": os.getloadavg()}


if __name__ == "__main__":
    main()
