"""The check every mixture-of-experts family passes against ``transformers`` (parent-process side).

For a tiny seeded checkpoint (tests/tiny_models.py), ``transformers`` generates 32
greedy tokens for each of 16 prompts (3 to 12 tokens) and scores each prompt. Our
``ModelRunner`` then runs, at one tensor-parallel degree, two jobs teacher-forced
with those completions (tests/worker/tp_harness.py):

* *alone*: the first 8 prompts one after another, each the only sequence of its steps;
* *at once*: all 16 in one batch (prefills together, then 31 decode steps of 16).

Every sampled token must equal ``transformers``' (or tie with it in both rows:
:func:`_same_greedy_choice`) and every sampled row's logits and prompt logprob match
its own within 1e-4 (float32); a prompt's logits alone and
in the batch of 16 agree to 1e-5 (the experts chosen are the same; only the GEMMs'
grouping differs); and each MoE layer's per-expert counts sum, over a job, to the
tokens it ran times ``num_experts_per_tok``, with no count from a dense layer.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import dataclasses
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.tiny_models import TinyModelSpec, load_hf_model, save_tiny_model
from tests.worker.tp_harness import Job, StepRecord, run_jobs
from tpserve.step import NewSequence, SamplingParams, ScheduledChunk, StepPlan

NUM_PROMPTS, NUM_ALONE, NUM_NEW_TOKENS, BLOCK_SIZE = 16, 8, 32, 4
MAX_PROMPT = 12
BLOCKS_PER_SEQ = -(-(MAX_PROMPT + NUM_NEW_TOKENS) // BLOCK_SIZE)
SAMPLING = SamplingParams(temperature=0.0, prompt_logprobs=0)


@dataclass(frozen=True)
class FamilyCase:
    """A tiny checkpoint, ``transformers``' outputs for it, and the two jobs."""

    model_dir: str
    prompts: list[tuple[int, ...]]
    completions: list[list[int]]
    logits: list[torch.Tensor]  # per prompt: (NUM_NEW_TOKENS, vocab) float32
    prompt_logprobs: list[torch.Tensor]  # per prompt: (len - 1,) float32
    top_k: int
    moe_layers: frozenset[int]
    jobs: tuple[Job, Job]  # alone, at once


@torch.no_grad()
def build_case(spec: TinyModelSpec, directory: Path, moe_layers: set[int], top_k: int) -> FamilyCase:
    """Save ``spec``'s checkpoint in ``directory`` and compute ``transformers``' reference."""
    save_tiny_model(spec, directory)
    return reference_case(spec, directory, moe_layers, top_k)


@torch.no_grad()
def reference_case(spec: TinyModelSpec, directory: Path, moe_layers: set[int], top_k: int) -> FamilyCase:
    """:func:`build_case` on a checkpoint already in ``directory`` (e.g. an int8 reference's dequantized weights)."""
    model = load_hf_model(directory)
    model.generation_config.eos_token_id = None  # exactly NUM_NEW_TOKENS
    rng = random.Random(spec.seed)
    prompts = [tuple(rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(3, MAX_PROMPT)))
               for _ in range(NUM_PROMPTS)]
    completions, logits, prompt_logprobs = [], [], []
    for prompt in prompts:
        ids = torch.tensor([prompt])  # (1, P)
        out = model.generate(ids, do_sample=False, max_new_tokens=NUM_NEW_TOKENS, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        completions.append(out.sequences[0, len(prompt):].tolist())
        logits.append(torch.cat(out.logits).float())  # (NUM_NEW_TOKENS, V)
        scores = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)  # (P - 1, V)
        prompt_logprobs.append(scores.gather(1, ids[0, 1:, None])[:, 0])  # (P - 1,)
    alone, at_once = _alone_plans(prompts[:NUM_ALONE], completions), _at_once_plans(prompts, completions)
    num_blocks = NUM_PROMPTS * BLOCKS_PER_SEQ
    jobs = (Job(f"{spec.name}_alone", str(directory), alone, num_blocks, BLOCK_SIZE),
            Job(f"{spec.name}_at_once", str(directory), at_once, num_blocks, BLOCK_SIZE))
    return FamilyCase(str(directory), prompts, completions, logits, prompt_logprobs, top_k, frozenset(moe_layers),
                      jobs)


def _steps(seq_ids: list[int], prompts: list[tuple[int, ...]], completions: list[list[int]], first_step: int,
           finished: tuple[int, ...]) -> list[StepPlan]:
    """The prefill of ``seq_ids`` together, then their decodes, teacher-forced with the completions."""
    new = tuple(NewSequence(i, SAMPLING, len(prompts[i]), prompt_token_ids=prompts[i]) for i in seq_ids)
    blocks = {i: tuple(range(n * BLOCKS_PER_SEQ, (n + 1) * BLOCKS_PER_SEQ)) for n, i in enumerate(seq_ids)}
    plans = [StepPlan(first_step, new, tuple(ScheduledChunk(i, prompts[i], 0, blocks[i]) for i in seq_ids), finished)]
    for j in range(1, NUM_NEW_TOKENS):
        chunks = tuple(ScheduledChunk(i, (completions[i][j - 1],), len(prompts[i]) + j - 1) for i in seq_ids)
        plans.append(StepPlan(first_step + j, scheduled=chunks))
    return plans


def _alone_plans(prompts: list[tuple[int, ...]], completions: list[list[int]]) -> tuple[StepPlan, ...]:
    plans: list[StepPlan] = []
    for i in range(len(prompts)):
        plans += _steps([i], prompts, completions, len(plans), (i - 1,) if i else ())
    return tuple(plans)


def _at_once_plans(prompts: list[tuple[int, ...]], completions: list[list[int]]) -> tuple[StepPlan, ...]:
    return tuple(_steps(list(range(len(prompts))), prompts, completions, 0, ()))


def at_once_job(case: FamilyCase, num_prompts: int, num_steps: int, graph_size: int | None = None) -> Job:
    """The first ``num_prompts`` prompts at once for ``num_steps`` steps; with ``graph_size``, through decode graphs.

    Off CUDA the graphs' static-buffer path runs eagerly (Triton's interpreter for attention),
    padding rows included: what a replayed graph computes.
    """
    plans = _at_once_plans(case.prompts[:num_prompts], case.completions)[:num_steps]
    return Job("short", case.model_dir, plans, NUM_PROMPTS * BLOCKS_PER_SEQ, BLOCK_SIZE,
               cuda_graph_sizes=(graph_size,) if graph_size else ())


def check_family(case: FamilyCase, tp: int) -> None:
    """Run both jobs at degree ``tp`` and check them (see the module docstring)."""
    records = run_jobs(list(case.jobs), tp_size=tp)
    check_records(case, case.jobs, records)


def expert_parallel_jobs(case: FamilyCase) -> tuple[Job, Job]:
    """The case's two jobs with ``--enable-expert-parallel`` (whole experts per rank)."""
    return with_expert_parallel(case.jobs)


def with_expert_parallel(jobs: tuple[Job, Job]) -> tuple[Job, Job]:
    """``jobs`` with ``--enable-expert-parallel`` (whole experts per rank), named ``..._ep``."""
    return tuple(dataclasses.replace(job, name=f"{job.name}_ep", enable_expert_parallel=True)
                 for job in jobs)  # type: ignore[return-value]


def served_jobs(case: FamilyCase, name: str, quantization: str | None) -> tuple[Job, Job]:
    """The case's jobs on ``case.model_dir`` (a float or quantized checkpoint), named ``name_alone`` /
    ``name_once``, served with ``--quantization quantization`` (None: the checkpoint's own config)."""
    return tuple(dataclasses.replace(job, name=f"{name}_{job.name.rsplit('_', 1)[-1]}", model_dir=case.model_dir,
                                     quantization=quantization) for job in case.jobs)  # type: ignore[return-value]


def records_by_degree(cases: dict[str, tuple[FamilyCase, tuple[Job, Job]]], *, tp1_only: Collection[str] = (),
                      expert_parallel: Collection[str] = (), triton: Collection[str] = ()) -> Callable[[int], dict]:
    """``tp -> records`` of every case's jobs at that degree, run once per degree (one spawn) and kept: at tp 2 also
    the ``expert_parallel`` cases' jobs expert-parallel and the ``triton`` ones' :func:`triton_job`; ``tp1_only``
    cases are left out at tp > 1."""
    cache: dict[int, dict] = {}

    def run(tp: int) -> dict:
        if tp not in cache:
            jobs = [job for name, (_, case_jobs) in cases.items() for job in case_jobs
                    if tp == 1 or name not in tp1_only]
            if tp == 2:
                jobs += [job for name in expert_parallel for job in with_expert_parallel(cases[name][1])]
                jobs += [triton_job(cases[name][1][1], name) for name in triton]
            cache[tp] = run_jobs(jobs, tp_size=tp)
        return cache[tp]

    return run


def triton_job(at_once: Job, name: str) -> Job:
    """The first 4 steps of the at-once job, expert-parallel, through the Triton experts (Triton's interpreter
    off CUDA)."""
    return dataclasses.replace(at_once, name=f"triton_ep_{name}", plans=at_once.plans[:4],
                               enable_expert_parallel=True, triton_experts=True)


def check_records(case: FamilyCase, jobs: tuple[Job, Job], records: dict[str, list[StepRecord]],
                  check_counts: bool = True, batch_bound: float = 1e-5) -> None:
    """Check the alone and at-once jobs' records (see the module docstring); ``check_counts``: see :func:`check_job`.

    ``batch_bound``: atol = rtol of a prompt's logits alone against in the batch (1e-5; int4 layers
    pick their kernel path by row count: tests/worker/test_moe_int4.py states its bound).
    """
    alone_logits = check_job(case, jobs[0], records[jobs[0].name], check_counts)
    batch_logits = check_job(case, jobs[1], records[jobs[1].name], check_counts)
    for i, logits in alone_logits.items():
        torch.testing.assert_close(logits, batch_logits[i], atol=batch_bound, rtol=batch_bound,
                                   msg=lambda m: f"prompt {i} alone vs in a batch of {NUM_PROMPTS}: {m}")


#: Logits this close are a tie in float32 (a few ulp at |logit| ~ 10): either token is a right greedy choice.
TIE = 1e-5


def _same_greedy_choice(ours: int, theirs: int, our_logits: torch.Tensor, their_logits: torch.Tensor) -> bool:
    """Whether greedy token ``ours`` agrees with ``transformers``' ``theirs``: equal, or the two tie in both rows.

    A seeded random model can put two tokens' logits within rounding of each other (seen: 10.2597 both,
    3e-6 apart, in opposite order in the two implementations); the steps are teacher-forced with
    ``transformers``' tokens, so such a tie changes nothing after it, and the logits are compared anyway.
    """
    return ours == theirs or all(abs(float(row[ours] - row[theirs])) <= TIE and float(row.max() - row[theirs]) <= TIE
                                 for row in (our_logits, their_logits))


def check_job(case: FamilyCase, job: Job, records: list[StepRecord], check_counts: bool = True
              ) -> dict[int, torch.Tensor]:
    """Tokens, logits, prompt logprobs and expert counts of one job; returns each prompt's (steps, V) logits.

    ``check_counts=False`` leaves out the expert counts (with pipeline stages the sampling rank
    reports only its own stage's layers).
    """
    assert len(records) == len(job.plans)
    rows: dict[int, list[torch.Tensor]] = defaultdict(list)
    scored: dict[int, list[float]] = defaultdict(list)
    counted: dict[int, int] = defaultdict(int)
    num_tokens = 0
    for plan, record in zip(job.plans, records, strict=True):
        seq_ids = [c.seq_id for c in plan.scheduled]
        step = [len(rows[i]) for i in seq_ids]
        for n, (i, j) in enumerate(zip(seq_ids, step)):
            assert _same_greedy_choice(record.sampled_token_ids[n], case.completions[i][j], record.logits[n],
                                       case.logits[i][j]), f"{job.name} step {plan.step_id} prompt {i}"
        for n, i in enumerate(seq_ids):
            rows[i].append(record.logits[n])
        for p in record.prompt_logprobs:
            scored[p.seq_id] += p.logprobs
        triples = record.expert_token_counts
        for layer, _, count in zip(triples[0::3], triples[1::3], triples[2::3]):
            counted[layer] += count
        num_tokens += sum(c.num_tokens for c in plan.scheduled)
    logits = {i: torch.stack(r) for i, r in rows.items()}
    for i, got in logits.items():
        torch.testing.assert_close(got, case.logits[i][:len(got)], atol=1e-4, rtol=1e-4, msg=lambda m: f"{job.name} {i}: {m}")
        torch.testing.assert_close(torch.tensor(scored[i]), case.prompt_logprobs[i], atol=1e-4, rtol=0,
                                   msg=lambda m: f"{job.name} prompt logprobs {i}: {m}")
    if check_counts:
        assert dict(counted) == {layer: num_tokens * case.top_k for layer in case.moe_layers}, job.name
    return logits
