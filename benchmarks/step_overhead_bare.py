"""The bare decode step of benchmarks/step_overhead.py: ``ModelRunner.execute`` alone, at tp 1 or more.

Plans are built as the scheduler builds them: every sequence prefilled in one step
(its prompt, the blocks it needs), then each decode step feeds every sequence its
last sampled token at its next position, with a new block id exactly when that
position starts a block. Default sampling (temperature 1), a distinct seed per
sequence. At tp > 1 every rank runs in its own spawned process over gloo (shared
memory all-reduce, as ``tpserve serve`` on one host), each with one thread, and
rank 0's times are reported.

Run by step_overhead.py in a subprocess whose ``sys.path`` starts with the tree
under test, so a baseline checkout's runner is what is timed::

    python benchmarks/step_overhead_bare.py --tensor-parallel-size 2 --sizes 1,16,64 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

PROMPT_LEN = 24
BLOCK_SIZE = 16


def _measure(ctx, model_dir: str, sizes: list[int], num_steps: int, dtype: str = "float32",
             cuda_graphs: bool = False, prompt_len: int = PROMPT_LEN) -> dict[str, float]:
    """Mean seconds of one decode ``execute`` per size (meaningful on rank 0), over ``num_steps`` decode
    steps at positions ``prompt_len .. prompt_len + num_steps - 1``: the positions a load of
    ``prompt_len``-token prompts and ``num_steps + 1`` output tokens decodes at, whose TPOT is the
    mean over the same steps (attention grows with the position). An untimed pass of the same plans
    goes first (warm-up). ``cuda_graphs``: decode steps replayed from graphs captured at exactly
    ``sizes`` (on CUDA, as a server does)."""
    import torch

    from worker.model_runner import ModelRunner

    runner = ModelRunner(model_dir, ctx, getattr(torch, dtype), block_size=BLOCK_SIZE)
    blocks_per_seq = -(-(prompt_len + num_steps + 1) // BLOCK_SIZE)
    runner.init_kv_cache(max(sizes) * blocks_per_seq, cuda_graph_sizes=tuple(sizes) if cuda_graphs else (),
                         max_model_len=blocks_per_seq * BLOCK_SIZE, capture=ctx.device.type == "cuda")
    means: dict[str, float] = {}
    step_id = 0
    for num_seqs in sizes:
        _, step_id = _one_pass(runner, num_seqs, num_steps, prompt_len, blocks_per_seq, step_id)  # warm-up
        times, step_id = _one_pass(runner, num_seqs, num_steps, prompt_len, blocks_per_seq, step_id)
        means[str(num_seqs)] = statistics.fmean(times)
    return means


def _one_pass(runner, num_seqs: int, num_steps: int, prompt_len: int, blocks_per_seq: int,
              step_id: int) -> tuple[list[float], int]:
    """Prefills ``num_seqs`` sequences, times ``num_steps`` decode steps, drops the sequences.
    Returns the decode steps' seconds and the next step id."""
    from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan

    vocab = runner.config.vocab_size
    tables = [list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq)) for s in range(num_seqs)]
    new = tuple(NewSequence(s, SamplingParams(seed=1000 + s), num_prompt_tokens=prompt_len) for s in range(num_seqs))
    prefill = tuple(ScheduledChunk(s, tuple((7 * s + 3 * j + 1) % vocab for j in range(prompt_len)), 0,
                                   tuple(tables[s][:-(-prompt_len // BLOCK_SIZE)])) for s in range(num_seqs))
    last = list(runner.execute(StepPlan(step_id, new, prefill)).sampled_token_ids)
    times = []
    for step in range(num_steps):
        step_id += 1
        position = prompt_len + step
        grow = position % BLOCK_SIZE == 0
        chunks = tuple(ScheduledChunk(s, (last[s] if last else 0,), position, (tables[s][position // BLOCK_SIZE],) if grow else ())
                       for s in range(num_seqs))
        started = time.perf_counter()
        result = runner.execute(StepPlan(step_id, scheduled=chunks))
        times.append(time.perf_counter() - started)
        last = list(result.sampled_token_ids)
    step_id += 1
    # Drop them: the next pass reuses their ids.
    runner.execute(StepPlan(step_id, finished_seq_ids=tuple(range(num_seqs))))
    return times, step_id + 1


def _rank_main(rank: int, tp_size: int, init_method: str, model_dir: str, sizes: list[int], num_steps: int,
               prompt_len: int, out_path: str) -> None:
    import torch

    from worker.parallel_state import destroy_distributed, init_distributed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ctx = init_distributed(rank, tp_size, init_method, "cpu", 120.0)
    try:
        means = _measure(ctx, model_dir, sizes, num_steps, prompt_len=prompt_len)
        if rank == 0:
            Path(out_path).write_text(json.dumps(means))
    finally:
        destroy_distributed()


def measure(model_dir: str, tensor_parallel_size: int, sizes: list[int], num_steps: int,
            prompt_len: int = PROMPT_LEN) -> dict[str, float]:
    """Mean seconds of one bare decode step per number of sequences over ``num_steps`` steps from
    position ``prompt_len`` (:func:`_measure`), rank 0's clock."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = str(Path(tmp) / "rank0.json")
        if tensor_parallel_size == 1:
            _rank_main(0, 1, "", model_dir, sizes, num_steps, prompt_len, out_path)
        else:
            mp.spawn(_rank_main, args=(tensor_parallel_size, f"tcp://127.0.0.1:{port}", model_dir, sizes, num_steps,
                                       prompt_len, out_path), nprocs=tensor_parallel_size, join=True)
        return json.loads(Path(out_path).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--sizes", default="1,16,64,256")
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per size")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help="prompt tokens: the first decode position")
    args = parser.parse_args()
    print(json.dumps(measure(args.model_dir, args.tensor_parallel_size, [int(s) for s in args.sizes.split(",")],
                             args.steps, args.prompt_len)))


if __name__ == "__main__":
    main()
