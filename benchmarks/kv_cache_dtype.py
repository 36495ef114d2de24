"""``--kv-cache-dtype int8|fp8`` against the float32 and the 16-bit caches: greedy agreement and decode-step time.

Agreement, one-process tp 1 runners with float32 activations (tests/worker/kv8_helpers.py), each cache
against each other cache's greedy lines (the references): float32 (stories260k: its goldens, which the
float32 cache reproduces), bfloat16 and float16 (float32 caches whose rows are rounded to 16 bits as they
are written: a 16-bit cache under the same activations and attention math). Samples: stories260k's goldens
(5 prompts x 64 tokens), the embedded model's 4 prompts x 32, and on each model 32 seeded prompts (BOS and
7 random ids; 64 and 32 tokens), a sample large enough to count near-ties. Per cache and reference:

* ``free_running``: each line generated greedily with the cache, the share of the reference's tokens
  reproduced position by position up to the line's first difference (a divergence costs the rest of
  the line; the figure tests/worker/test_kv_cache_dtype.py asserts);
* ``free_running_positional``: the same lines, every position compared (chance matches after a
  divergence count);
* ``teacher_forced``: each position's greedy token given the reference prefix;

and against the float32 cache ``logit_error_over_std``: teacher-forced, each position's logits less the
float32 cache's, RMS and largest, over the float32 logits' standard deviation (the steady measure: a
free-running figure counts which near-ties the error happens to flip).

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
from tests.worker.kv8_helpers import (  # noqa: E402
    GREEDY,
    eight_bit_runner,
    rounded_cache_runner,
    sixteen_bit,
    teacher_forced,
)
from tpserve.embedded_model import default_model_dir  # noqa: E402
from tpserve.step import NewSequence, ScheduledChunk, StepPlan  # noqa: E402
from worker.model_runner import ModelRunner  # noqa: E402

EMBEDDED_PROMPTS = [[1, 9, 33, 7, 120], [1, 400, 12], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 77]]
#: The wider sample's prompts: BOS and 7 token ids drawn with this seed, 32 of them.
WIDE_SEED = 1


def prefix_share(got: list[list[int]], want: list[list[int]]) -> float:
    """Tokens of ``want`` reproduced up to each line's first difference, over all of ``want``'s tokens."""
    kept = sum(next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want))
    return kept / sum(map(len, want))


def positional_share(got: list[list[int]], want: list[list[int]]) -> float:
    """Tokens of ``want`` equal to ``got``'s at the same position, over all of ``want``'s tokens."""
    return sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / sum(map(len, want))


#: The caches compared: the 16-bit ones as float32 caches holding rows rounded to 16 bits (the same float32
#: activations and attention math; tests/worker/kv8_helpers.py), the 8-bit ones as served.
SIXTEEN_BIT = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_runner(model_dir: Path, cache: str, num_blocks: int) -> ModelRunner:
    """A tp 1 float32 runner whose cache is ``cache``: float32 (``auto``), bfloat16, float16, int8 or fp8."""
    if cache in SIXTEEN_BIT:
        return rounded_cache_runner(model_dir, sixteen_bit(SIXTEEN_BIT[cache]), num_blocks=num_blocks)
    return eight_bit_runner(model_dir, cache, num_blocks=num_blocks)


def figures(runner: ModelRunner, prompts: list[list[int]], references: dict[str, list[list[int]]],
            reference_logits: list[torch.Tensor]) -> dict:
    """One cache's agreement with each reference's lines (module docstring) and its teacher-forced logits'
    error against the float32 cache's: RMS and largest difference, over the float32 logits' standard deviation."""
    free = teacher_forced(runner, prompts, None, len(references["float32"][0]))
    out: dict = {}
    for name, want in references.items():
        logits: list[torch.Tensor] = []
        forced = teacher_forced(runner, prompts, want, logits=logits if name == "float32" else None)
        out[f"vs_{name}"] = {"free_running": round(prefix_share(free, want), 4),
                             "free_running_positional": round(positional_share(free, want), 4),
                             "teacher_forced": round(positional_share(forced, want), 4)}
        if name == "float32":
            diff, ref = torch.stack(logits) - torch.stack(reference_logits), torch.stack(reference_logits)
            out["logit_error_over_std"] = {"rms": round(float(diff.pow(2).mean().sqrt() / ref.std()), 5),
                                           "max": round(float(diff.abs().max() / ref.std()), 4)}
    out["lines_diverging_vs_float32"] = sum(f != w for f, w in zip(free, references["float32"], strict=True))
    return out


def agreement_samples() -> dict[str, tuple[Path, list[list[int]], int, int]]:
    """Name -> (model directory, prompts, greedy tokens per prompt, KV blocks): stories260k's goldens, the embedded
    model's prompts, and 32 seeded prompts on each (shared by benchmarks/kv_cache_fp8_variants.py)."""
    goldens = [json.loads(line) for line in GOLDENS_PATH.read_text().splitlines() if line.strip()]
    generator = torch.Generator().manual_seed(WIDE_SEED)
    wide = [[1, *torch.randint(3, 512, (7,), generator=generator).tolist()] for _ in range(32)]
    return {"stories260k_goldens": (STORIES_DIR, [g["prompt_token_ids"] for g in goldens], 64, 48),
            "embedded": (default_model_dir(), EMBEDDED_PROMPTS, 32, 48),
            "stories260k_32_prompts": (STORIES_DIR, wide, 64, 200),
            "embedded_32_prompts": (default_model_dir(), wide, 32, 200)}


def agreement(caches: list[str]) -> dict:
    """Per sample (stories260k's goldens, the embedded model's prompts, 32 seeded prompts on each) and cache:
    :func:`figures` against the float32, bfloat16 and float16 caches' greedy lines."""
    goldens = [json.loads(line) for line in GOLDENS_PATH.read_text().splitlines() if line.strip()]
    samples = agreement_samples()
    out: dict = {}
    for sample, (model_dir, prompts, num_tokens, num_blocks) in samples.items():
        float_runner = eight_bit_runner(model_dir, "auto", num_blocks=num_blocks)
        float_lines = teacher_forced(float_runner, prompts, None, num_tokens)
        if sample == "stories260k_goldens":
            assert float_lines == [g["completion_token_ids"] for g in goldens]  # the float32 cache is the goldens
        reference_logits: list[torch.Tensor] = []
        teacher_forced(float_runner, prompts, float_lines, logits=reference_logits)
        references = {"float32": float_lines}
        for name in SIXTEEN_BIT:
            references[name] = teacher_forced(cache_runner(model_dir, name, num_blocks), prompts, None, num_tokens)
        out[sample] = {"lines": len(prompts), "tokens": len(prompts) * num_tokens}
        for cache in caches:
            own = {k: v for k, v in references.items() if k != cache}
            out[sample][cache] = figures(cache_runner(model_dir, cache, num_blocks), prompts, own, reference_logits)
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
        result["agreement"] = agreement(["bfloat16", "float16", *dtypes])
    result["decode_step_ms"] = {"batch": args.batch, "context": args.context, "steps": args.steps,
                                **decode_steps(["auto", *dtypes], args.batch, args.context, args.steps)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
