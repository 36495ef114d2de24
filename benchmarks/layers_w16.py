"""A 16-bit checkpoint's decoder projections kept in their 16 bits on a CPU (worker/layers_w16.py) against their
float32 copies, in one run.

The 94.9M-parameter Llama of benchmarks/peer_comparison.py (float32, seed 0: 30 layers, hidden 512) stored as
checkpoints are published, in bfloat16 and in float16, served with float32 activations (``--dtype float32``,
the CPU default). For each, one ``ModelRunner`` (tp 1, this process, every core) keeps the projections 16-bit
(the default) and one widens them to float32 at load (the baseline: ``takes_w16_layers`` patched to False; the
LM head, 512 x 512, is kept 16-bit in both). First the two runners' logits over a 32-token prefill and 8 decodes
are compared (they must be equal, bit for bit); then each round times every runner's bare decode step at batch 1
and 16 (benchmarks/peer_comparison.py ``bare_steps``) and a 512-token prefill (one sequence, one chunk: the
projections then multiply a float32 copy widened for the call), the runners in turn; medians and the
within-round ratios are reported, with the bytes each runner holds. And the peak memory of loading each model in
a fresh process (``load_peak_rss_mb``, :data:`LOADS`): widened, loaded in float32 and then held 16-bit, and
allocated 16-bit before loading (the default). With ``--baseline-repo`` (a checkout from before, which widens the
layers), the bfloat16 model is also served from both trees (tp 1), one request at a time: client ms/token of
peer_comparison's ``single``, ``--rounds`` interleaved rounds.

    .venv/bin/python benchmarks/layers_w16.py --rounds 5 --out benchmarks/results
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lm_head_int8 import REPO, bare_rounds, bare_step_parser, finish, served_ab, speedup  # noqa: E402
from benchmarks.lm_head_w16 import paired_runners  # noqa: E402
from benchmarks.peer_comparison import MODEL_CONFIG, bare_runner, build_model, machine_description  # noqa: E402
from worker.memory import weight_bytes  # noqa: E402

PREFILL_TOKENS = 512


def _runner(model_dir: Path, keep: bool):
    with contextlib.nullcontext() if keep else mock.patch("worker.loader.takes_w16_layers", return_value=False):
        return bare_runner(model_dir)


def prefill_ms(runner, tokens: int = PREFILL_TOKENS) -> float:
    """Wall ms of one ``tokens``-token prompt prefilled in one step (a fresh sequence, then finished)."""
    from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan

    blocks = -(-tokens // runner.block_size)
    runner.init_kv_cache(blocks + 1)
    plan = StepPlan(1, (NewSequence(0, SamplingParams(temperature=0)),),
                    (ScheduledChunk(0, tuple(3 + i % 500 for i in range(tokens)), 0, tuple(range(blocks))),))
    start = time.perf_counter()
    runner.execute(plan)
    elapsed = time.perf_counter() - start
    runner.execute(StepPlan(2, (), (), finished_seq_ids=(0,)))
    return elapsed * 1e3


#: The loads whose peak memory is measured: the projections widened to float32 (the baseline), loaded in float32
#: and held 16-bit afterwards by their values (``allocate_16bit_projections`` off), allocated 16-bit before loading.
LOADS = {"float32_layers": "mock.patch('worker.loader.takes_w16_layers', return_value=False)",
         "kept_after_float32_load": "mock.patch('worker.loader.allocate_16bit_projections')",
         "allocated_16bit": "contextlib.nullcontext()"}


def load_peak_rss_mb(model_dir: Path, load: str) -> float:
    """Peak resident MB of a fresh process while it loads ``model_dir`` into a tp-1 ``ModelRunner`` (no KV cache),
    by ``load`` (:data:`LOADS`), less its resident MB before (Python, torch and the kernels): Linux's ``VmHWM``,
    reset first (``/proc/self/clear_refs``), so only the load's peak counts."""
    code = f"""
import contextlib, sys
from pathlib import Path
from unittest import mock
import torch
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
import worker.kernels
from worker.model_runner import ModelRunner
from worker.parallel_state import ParallelContext
worker.kernels.cpu_kernels_available()
def status(key):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1]) / 1024
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident size
before = status("VmRSS")
with {LOADS[load]}:
    ModelRunner({str(model_dir)!r}, ParallelContext.single(), torch.float32, 16)
print(status("VmHWM") - before)
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = bare_step_parser(__doc__, "layers_w16.json")
    parser.add_argument("--baseline-repo", type=Path, default=None,
                        help="a checkout that widens 16-bit layers to float32: serve the bfloat16 model from both trees")
    args = parser.parse_args()
    from tests.worker.int8_checkpoints import save_cast

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        source = build_model(root / "float32", 0)
        models = {"bf16": save_cast(source, root / "bf16", torch.bfloat16),
                  "fp16": save_cast(source, root / "fp16", torch.float16)}
        runners, equal = paired_runners(models, _runner, "16bit_layers", "float32_layers")
        held = {name: weight_bytes(r.model) for name, r in runners.items()}
        peak = {m: {load: round(load_peak_rss_mb(models[m], load), 1) for load in LOADS} for m in models}
        times = bare_rounds(runners, args.rounds, args.context, args.steps)
        prefill: dict[str, list[float]] = {name: [] for name in runners}
        for rnd in range(args.rounds):
            for name in (list(runners) if rnd % 2 == 0 else list(reversed(runners))):
                prefill_ms(runners[name])  # warm: the first prefill of a fresh cache pays its page faults
                prefill[name].append(prefill_ms(runners[name]))
            print(f"prefill round {rnd}: " + ", ".join(f"{n} {prefill[n][-1]:.1f} ms" for n in runners), flush=True)
        del runners  # the servers' ranks below need the memory
        served = None
        if args.baseline_repo is not None:
            tpot = served_ab(models["bf16"], {"float32_layers": args.baseline_repo.resolve(), "16bit_layers": REPO},
                             {"bf16": ()}, args.rounds)
            served = {"baseline": str(args.baseline_repo.resolve()),
                      "decode_ms_per_token": {n: round(statistics.median(v), 3) for n, v in tpot.items()},
                      "speedup_16bit_layers": speedup(tpot["bf16_float32_layers"], tpot["bf16_16bit_layers"])}
    report: dict = {
        "what": __doc__.split("\n\n")[0], "machine": machine_description(), "torch": torch.__version__,
        "shape": MODEL_CONFIG, "rounds": args.rounds, "context": args.context, "steps": args.steps,
        "logits_bit_identical": equal, "weight_bytes": held, "load_peak_rss_mb": peak,
        "decode_step_ms": {n: {b: round(statistics.median(v), 3) for b, v in t.items()} for n, t in times.items()},
        "prefill_ms": {n: round(statistics.median(v), 2) for n, v in prefill.items()},
        "prefill_tokens": PREFILL_TOKENS,
        "speedup_16bit_layers": {},
    }
    for m in models:
        for batch in (1, 16):
            report["speedup_16bit_layers"][f"{m}_batch{batch}"] = speedup(times[f"{m}_float32_layers"][batch],
                                                                          times[f"{m}_16bit_layers"][batch])
        report["speedup_16bit_layers"][f"{m}_prefill"] = speedup(prefill[f"{m}_float32_layers"],
                                                                 prefill[f"{m}_16bit_layers"])
    if served is not None:
        report["served"] = served
    finish(report, args.out, args.name)


if __name__ == "__main__":
    main()
