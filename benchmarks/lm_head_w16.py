"""A 16-bit checkpoint's LM head kept in its 16 bits on a CPU (worker/lm_head_w16.py) against its float32 copy, in one run.

benchmarks/lm_head_int8.py's 0.16B model with a 32,000-token vocabulary (a fifth of its parameters the head),
stored two ways, as checkpoints are published: in bfloat16 (a float model, served with float32 activations),
and as a 4-bit GPTQ checkpoint (groups of 128, symmetric; written by tests/worker/int4_checkpoints.py's
``save_gptq`` from the model in float16, so its head is float16, as GPTQ releases store it). For each, one
``ModelRunner`` (tp 1, this process) keeps the head 16-bit (the default) and one widens it to float32 at load
(the baseline: ``takes_w16_head`` patched to False). First the two runners' logits over a prefill and decodes
are compared (they must be equal, bit for bit); then each round times every runner's bare decode step at batch
1 and 16 (benchmarks/peer_comparison.py ``bare_steps``), the runners in turn; medians and the within-round
ratios are reported; last, the head's product alone (``linear_w16`` against ``linear_f32``) at 1-64 rows of x.

    .venv/bin/python benchmarks/lm_head_w16.py --rounds 5 --out benchmarks/results
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lm_head_int8 import (  # noqa: E402
    SHAPE, bare_rounds, bare_step_parser, build_real_vocab_model, finish, speedup)
from benchmarks.peer_comparison import bare_runner, machine_description  # noqa: E402
from worker.memory import weight_bytes  # noqa: E402


def _runner(model_dir: Path, keep: bool):
    with contextlib.nullcontext() if keep else mock.patch("worker.loader.takes_w16_head", return_value=False):
        return bare_runner(model_dir)


def _logits(runner) -> list[torch.Tensor]:
    """Each step's logits over a 32-token prefill and 8 greedy decodes (one sequence)."""
    from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan

    runner.init_kv_cache(8)
    out = runner.execute(StepPlan(1, (NewSequence(0, SamplingParams(temperature=0)),),
                                  (ScheduledChunk(0, tuple(range(3, 35)), 0, tuple(range(8))),)))
    rows, token = [runner.last_logits.clone()], out.sampled_token_ids[0]
    for i in range(8):
        out = runner.execute(StepPlan(2 + i, (), (ScheduledChunk(0, (token,), 32 + i),)))
        rows.append(runner.last_logits.clone())
        token = out.sampled_token_ids[0]
    runner.execute(StepPlan(100, (), (), finished_seq_ids=(0,)))
    return rows


def paired_runners(models: dict[str, Path], runner, kept: str, widened: str) -> tuple[dict, dict[str, bool]]:
    """Per model of ``models`` (name -> checkpoint) a runner ``runner(dir, True)`` named ``{model}_{kept}`` and
    ``runner(dir, False)`` named ``{model}_{widened}``; and per model whether the two give the same logits, bit for
    bit, over :func:`_logits`' steps."""
    runners = {f"{m}_{variant}": runner(models[m], variant == kept) for m in models for variant in (kept, widened)}
    equal = {m: all(torch.equal(a, b) for a, b in zip(_logits(runners[f"{m}_{kept}"]),
                                                        _logits(runners[f"{m}_{widened}"]), strict=True))
             for m in models}
    return runners, equal


def head_alone(rows: tuple[int, ...] = (1, 8, 9, 16, 32, 48, 64), repeats: int = 20) -> dict:
    """The head's product alone, :data:`SHAPE`'s ``(vocab, hidden)`` matrix: ``linear_w16`` on bfloat16 and float16
    copies against ``linear_f32`` on the float32 one (this process's threads), median ms over ``repeats`` calls
    each, the three interleaved, at each row count of x."""
    import time

    ops = torch.ops.tpserve_cpu
    g = torch.Generator().manual_seed(0)
    w = torch.randn(SHAPE["vocab_size"], SHAPE["hidden_size"], generator=g)
    weights = {"float32": w, "bfloat16": w.to(torch.bfloat16), "float16": w.to(torch.float16)}
    out: dict = {}
    for m in rows:
        x = torch.randn(m, SHAPE["hidden_size"], generator=g)
        calls = {"float32": lambda: ops.linear_f32(x, weights["float32"], None),
                 "bfloat16": lambda: ops.linear_w16(x, weights["bfloat16"], None),
                 "float16": lambda: ops.linear_w16(x, weights["float16"], None)}
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(repeats):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append((time.perf_counter() - start) * 1e3)
        out[m] = {name: round(statistics.median(v), 3) for name, v in times.items()}
        print(f"head alone, {m} rows: {out[m]}", flush=True)
    return out


def main() -> None:
    args = bare_step_parser(__doc__, "lm_head_w16.json").parse_args()
    from tests.worker.int4_checkpoints import save_gptq
    from tests.worker.int8_checkpoints import save_cast

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        source = build_real_vocab_model(root / "float32", 0)
        models = {"bf16": save_cast(source, root / "bf16", torch.bfloat16)}
        models["gptq_int4"], _ = save_gptq(save_cast(source, root / "fp16", torch.float16), root / "gptq", root / "gptq_ref",
                                          group=128, sym=True, desc_act=False)
        runners, equal = paired_runners(models, _runner, "16bit_head", "float32_head")
        held = {name: weight_bytes(r.model) for name, r in runners.items()}
        head_dtype = {name: str(r.model.lm_head.weight.dtype) for name, r in runners.items()}
        times = bare_rounds(runners, args.rounds, args.context, args.steps)
    report: dict = {
        "what": __doc__.split("\n\n")[0], "machine": machine_description(), "torch": torch.__version__,
        "shape": SHAPE, "rounds": args.rounds, "context": args.context, "steps": args.steps,
        "logits_bit_identical": equal, "lm_head_dtype": head_dtype, "weight_bytes": held,
        "decode_step_ms": {n: {b: round(statistics.median(v), 3) for b, v in t.items()} for n, t in times.items()},
        "speedup_16bit_head": {},
        "head_alone_ms": head_alone(),
    }
    for m in models:
        for batch in (1, 16):
            report["speedup_16bit_head"][f"{m}_batch{batch}"] = speedup(times[f"{m}_float32_head"][batch],
                                                                        times[f"{m}_16bit_head"][batch])
    finish(report, args.out, args.name)


if __name__ == "__main__":
    main()
