"""One model family against ``transformers`` at several tensor-parallel degrees (parent side of its tests).

The scenario of docs/design/models.md ("Model families: the registry"), for a tiny seeded checkpoint whose sliding
window (if any)
is a few blocks long, so that blocks fall out of it:

* **alone**: 8 prompts of 3 to 40 tokens, one sequence at a time, 32 greedy tokens each;
  the first four also ask for their prompt logprobs;
* **16 at once**: every prompt twice. The second copies arrive one step later: odd ones
  prefill in chunks of ``window`` tokens (a chunk boundary on the window's edge), even
  ones hit the prefix cache of their first copy (whole shared blocks, the rest
  prefilled); two copies are preempted after 12 tokens, past the window, and recomputed;
  the first two originals ask for their prompt logprobs.

A hybrid model (state layers, worker/state_cache.py) runs the same plans with live state slots, a
state checkpoint at every prompt block boundary, and each prefix hit resuming from the source's
checkpoint at the shared boundary (tests/worker/scenarios.py): chunked prefill carries the state
across chunks, a preempted sequence recomputes from a zeroed slot.

Every sampled token must equal ``transformers``' greedy ``generate``, the logits of every
sampled row (float32) ``transformers``' within 1e-4, and the prompt logprobs the
log-softmax of ``transformers``' logits within 1e-4.

Starting a process group costs more than the tiny models' steps, so every family test
module registers its checkpoints at import (:func:`register`; pytest imports every
module before it runs any test) and the first test to ask for a degree runs every
registered checkpoint's jobs in one group (:func:`records_at`).
"""

from __future__ import annotations

import atexit
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.tiny_models import TinyModelSpec, load_hf_model, save_tiny_model
from tests.worker.scenarios import GREEDY, SeqSpec, build_plans, hf_reference
from tests.worker.tp_harness import Job, StepRecord, run_jobs
from tpserve.model_config import ModelConfig
from tpserve.step import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 512
NUM_NEW_TOKENS = 32
PROMPT_LENGTHS = (3, 9, 17, 24, 30, 12, 40, 6)
WITH_PROMPT_LOGPROBS = SamplingParams(temperature=0.0, prompt_logprobs=2)


@dataclass(frozen=True)
class FamilyCase:
    """The jobs of one checkpoint and what rank 0 must report for them."""

    jobs: tuple[Job, ...]
    expected: dict[str, list[list[tuple[int, int]]]]  # job name -> per step: (seq_id, completion index)
    completions: dict[int, list[int]]  # seq_id -> greedy tokens
    logits: dict[int, torch.Tensor]  # seq_id -> (NUM_NEW_TOKENS, vocab) float32
    prompt_log_softmax: dict[int, torch.Tensor]  # seq_id -> (len(prompt), vocab): row i predicts token i + 1
    prompts: dict[int, tuple[int, ...]]


def prepare(spec: TinyModelSpec, directory: Path, window: int | None, seed: int = 0) -> FamilyCase:
    """Save ``spec``'s checkpoint in ``directory``, compute ``transformers``' reference and the plans."""
    save_tiny_model(spec, directory)
    hybrid = bool(ModelConfig.from_pretrained(directory).state_layer_indices)  # state slots and checkpoints
    model = load_hf_model(directory)
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prompts = [tuple(rng.randrange(3, vocab) for _ in range(n)) for n in PROMPT_LENGTHS]
    if (getattr(model.config, "rope_parameters", None) or {}).get("rope_type") == "dynamic" or hybrid:
        # Hybrids: the reference's decode steps run its recurrent form (the state carried token by token), its
        # one forward over prompt + completion the chunked form: the served decode is scored against the former.
        # Nemotron-H's config has no rope_parameters.
        completions, logits, log_softmax = _dynamic_rope_reference(model, prompts)
    else:
        completions, logits = hf_reference(model, [SeqSpec(i, p, NUM_NEW_TOKENS) for i, p in enumerate(prompts)])
        with torch.no_grad():
            log_softmax = {i: torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1)
                           for i, p in enumerate(prompts)}
    n = len(prompts)
    step = window or 8
    alone = [SeqSpec(i, p, NUM_NEW_TOKENS, WITH_PROMPT_LOGPROBS if i < 4 else GREEDY, arrive_step=33 * i)
             for i, p in enumerate(prompts)]
    together = [SeqSpec(i, p, NUM_NEW_TOKENS, WITH_PROMPT_LOGPROBS if i in (1, 6) else GREEDY)
                for i, p in enumerate(prompts)]
    together += [SeqSpec(n + i, p, NUM_NEW_TOKENS, arrive_step=1,
                         prefill_chunk=step if i % 2 else None, prefix_from=None if i % 2 else i,
                         preempt_after=12 if i in (2, 3) else None)
                 for i, p in enumerate(prompts)]
    for i in range(n):  # the copies generate what their originals do
        completions[n + i], logits[n + i] = completions[i], logits[i]
    jobs, expected = [], {}
    for name, seqs in (("alone", alone), ("together", together)):
        plans, want = build_plans(seqs, completions, BLOCK_SIZE, NUM_BLOCKS, seed=seed, state_slots=hybrid)
        job_name = f"{spec.name}/{name}"
        jobs.append(Job(job_name, str(directory), tuple(plans), NUM_BLOCKS, BLOCK_SIZE))
        expected[job_name] = want
    return FamilyCase(tuple(jobs), expected, completions, logits, log_softmax, dict(enumerate(prompts)))


@torch.no_grad()
def _dynamic_rope_reference(model: torch.nn.Module, prompts: list[tuple[int, ...]]):
    """``generate``'s own per-step logits, each sequence from a fresh rotary state (dynamic NTK RoPE; hybrids).

    ``transformers`` rescales per forward and keeps the largest length seen across calls, and its
    cache keeps each key as rotated then, so one forward over prompt + completion (what
    :func:`hf_reference` scores) is not what ``generate`` computed; and a previous, longer
    sequence would leak its scale into the next. Each prompt therefore starts from the
    rotary embedding's initial state, and the logits are ``generate``'s.
    """
    # NoPE hybrids (Granite 4 without RoPE, Nemotron-H's ``backbone``) have no rotary state to reset.
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)

    def reset() -> None:
        if rotary is not None:
            rotary.register_buffer("inv_freq", rotary.original_inv_freq.clone(), persistent=False)
            rotary.max_seq_len_cached = rotary.original_max_seq_len

    model.generation_config.eos_token_id = None
    completions, logits, log_softmax = {}, {}, {}
    for i, prompt in enumerate(prompts):
        reset()
        log_softmax[i] = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        reset()
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NUM_NEW_TOKENS, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        completions[i] = out.sequences[0, len(prompt):].tolist()
        logits[i] = torch.cat(out.logits).float()  # (NUM_NEW_TOKENS, vocab)
    return completions, logits, log_softmax


_REGISTERED: dict[str, tuple[TinyModelSpec, int | None]] = {}
_TP_SIZES: dict[str, tuple[int, ...]] = {}  # name -> the degrees its model splits over
_CASES: dict[str, FamilyCase] = {}
_RECORDS: dict[int, dict[str, list[StepRecord]]] = {}


def register(spec: TinyModelSpec, window: int | None, tp_sizes: tuple[int, ...] = (1, 2, 4)) -> str:
    """Declare a checkpoint (at a test module's import); returns its name for :func:`case` and :func:`check`.

    ``tp_sizes``: the degrees its model splits over and its tests check; the group run at a degree
    (:func:`records_at`) holds only the checkpoints declared for it.

    Every family is held to the same 1e-4 (module docstring): a tiny checkpoint on which the reference's own
    float32 paths disagree by more is ill-conditioned, and is to be redrawn well-conditioned (as the Gated
    DeltaNet ones are, tests/tiny_models.py's ``_correlate_queries_with_keys``), not given a looser tolerance.
    """
    _REGISTERED[spec.name] = (spec, window)
    _TP_SIZES[spec.name] = tp_sizes
    return spec.name


def case(name: str) -> FamilyCase:
    """The prepared case of a registered checkpoint (every registered one prepared on first use)."""
    if not _CASES:
        root = Path(tempfile.mkdtemp(prefix="tpserve-families-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        for seed, (spec, window) in enumerate(_REGISTERED.values()):
            _CASES[spec.name] = prepare(spec, root / spec.name, window, seed=seed)
    return _CASES[name]


def records_at(tp: int) -> dict[str, list[StepRecord]]:
    """Rank 0's records of every registered checkpoint's jobs at degree ``tp``, run once in one group."""
    if tp not in _RECORDS:
        case(next(iter(_REGISTERED)))
        _RECORDS[tp] = run_jobs([job for name, c in _CASES.items() if tp in _TP_SIZES[name] for job in c.jobs],
                                tp_size=tp)
    return _RECORDS[tp]


def check(name: str, tp: int) -> None:
    """Assert checkpoint ``name``'s tokens, logits and prompt logprobs at degree ``tp`` equal the reference's."""
    if tp not in _TP_SIZES[name]:
        raise ValueError(f"{name} is registered for tp {_TP_SIZES[name]}, not {tp}")
    family, records = case(name), records_at(tp)
    _check(family, records)


def _check(case: FamilyCase, records: dict[str, list[StepRecord]]) -> None:
    for job in case.jobs:
        steps, want = records[job.name], case.expected[job.name]
        assert len(steps) == len(want)
        scored = 0
        for step, (record, samples) in enumerate(zip(steps, want, strict=True)):
            tokens = tuple(case.completions[seq_id][index] for seq_id, index in samples)
            assert record.sampled_token_ids == tokens, f"{job.name} step {step}: samples {samples}"
            if samples:
                expected_logits = torch.stack([case.logits[seq_id][index] for seq_id, index in samples])
                torch.testing.assert_close(record.logits, expected_logits, atol=1e-4, rtol=1e-4,
                                           msg=lambda m, step=step: f"{job.name} step {step}: {m}")
            for scores in record.prompt_logprobs:
                reference = case.prompt_log_softmax[scores.seq_id]
                prompt = case.prompts[scores.seq_id]
                for i, logprob in enumerate(scores.logprobs):
                    position = scores.first_position + i
                    assert abs(logprob - float(reference[position - 1, prompt[position]])) < 1e-4
                    scored += 1
        asked = range(4) if job.name.endswith("/alone") else (1, 6)
        assert scored == sum(len(case.prompts[i]) - 1 for i in asked)  # every asked prompt token
