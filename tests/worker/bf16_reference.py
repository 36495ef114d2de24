"""bfloat16 runs of the standard scenario and their check against ``transformers`` in bfloat16.

Shared by the CPU test (tests/worker/test_bf16.py, gloo) and the GPU test
(tests/worker/test_gpu.py, NCCL), which differ only in the device.

Each case: a tiny checkpoint runs ``scenarios.standard_specs`` (chunked prefill,
mixed decodes, a preemption), teacher-forced with the float32 reference
completions, in bfloat16. At every sampled position our logits are compared with
``transformers``' bfloat16 logits of the same tokens on the same device.

Stated tolerance, per step, with ``e_hf = max |hf_bf16 - hf_fp32|`` (transformers'
own bfloat16 error):

* ``max |ours - hf_bf16| <= 2 * e_hf + 0.02`` (we stray from transformers' bfloat16
  result by no more than twice its own rounding error: the bfloat16 activations
  round differently in a fused QKV/gate-up layout, a paged cache and, at degree 2,
  a row-parallel all-reduce);
* ``max |ours - hf_fp32| <= 1.5 * e_hf + 0.02`` (we are no less accurate than
  transformers in bfloat16; our logits themselves are computed in float32).

Measured on the CPU (logits up to ~23, where one bfloat16 ulp is 0.125):
``e_hf`` 0.13-0.26, ours against hf_bf16 0.09-0.23, ours against fp32 0.13-0.21.
Greedy tokens must equal transformers' bfloat16 argmax wherever its top-2 margin
exceeds the first tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tests.tiny_models import TINY_MODELS, TinyModelSpec, load_hf_model
from tests.worker.scenarios import build_plans, hf_reference, standard_specs
from tests.worker.tp_harness import Job, StepRecord

BLOCK_SIZE = 4
NUM_BLOCKS = 64


@dataclass(frozen=True)
class Bf16Case:
    """A bfloat16 job and its references (per seq_id: ``(num_new_tokens, vocab)`` float32 on the CPU)."""

    job: Job
    expected: list[list[tuple[int, int]]]
    logits_bf16: dict[int, torch.Tensor]
    logits_fp32: dict[int, torch.Tensor]


def bf16_cases(checkpoints: dict[str, Path], names: tuple[str, ...], device: str = "cpu",
               extra: tuple[TinyModelSpec, ...] = ()) -> dict[str, Bf16Case]:
    """The cases of the checkpoints ``names`` (of tests/tiny_models.py's set, or of ``extra``); the bfloat16
    reference runs on ``device``."""
    cases = {}
    for i, spec in enumerate((*TINY_MODELS, *extra)):
        if spec.name not in names:
            continue
        model_dir = checkpoints[spec.name]
        fp32 = load_hf_model(model_dir)
        specs = standard_specs(fp32.config.vocab_size, seed=i)
        completions, logits32 = hf_reference(fp32, specs)
        bf16 = load_hf_model(model_dir, torch.bfloat16).to(device)
        logits16 = {}
        with torch.no_grad():
            for s in specs:
                full = torch.tensor([list(s.prompt) + completions[s.seq_id][:-1]], device=device)  # (1, P + n - 1)
                logits16[s.seq_id] = bf16(full).logits[0, len(s.prompt) - 1 :].float().cpu()  # (n, V)
        plans, expected = build_plans(specs, completions, BLOCK_SIZE, NUM_BLOCKS, seed=i)
        job = Job(spec.name, str(model_dir), tuple(plans), NUM_BLOCKS, BLOCK_SIZE, dtype=torch.bfloat16)
        cases[spec.name] = Bf16Case(job, expected, logits16, logits32)
    return cases


def check_bf16(case: Bf16Case, records: list[StepRecord], label: str) -> float:
    """Assert the module's tolerances at every sampled step; return the worst ``|ours - hf_bf16|``."""
    worst = 0.0
    for step, (record, samples) in enumerate(zip(records, case.expected, strict=True)):
        if not samples:
            continue
        ours = record.logits.float().cpu()  # (N, V)
        ref16 = torch.stack([case.logits_bf16[s][i] for s, i in samples])  # (N, V)
        ref32 = torch.stack([case.logits_fp32[s][i] for s, i in samples])  # (N, V)
        hf_error = float((ref16 - ref32).abs().max())
        tolerance = 2 * hf_error + 0.02
        error = float((ours - ref16).abs().max())
        worst = max(worst, error)
        assert error <= tolerance, f"{label} step {step}: {error:.4f} > {tolerance:.4f}"
        our_error = float((ours - ref32).abs().max())
        assert our_error <= 1.5 * hf_error + 0.02, f"{label} step {step}: {our_error:.4f} vs {hf_error:.4f}"
        top2 = ref16.topk(2, dim=-1).values  # (N, 2)
        clear = (top2[:, 0] - top2[:, 1]) > tolerance  # (N,) rows whose argmax cannot flip
        assert torch.equal(ours.argmax(-1)[clear], ref16.argmax(-1)[clear]), f"{label} step {step}"
    return worst
