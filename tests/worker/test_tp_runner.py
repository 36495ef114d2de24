"""ModelRunner at tensor-parallel degrees 1, 2 and 4 against Hugging Face ``transformers``.

Each tiny checkpoint runs the scenario of ``scenarios.standard_specs``: in one
step, prefills of sequences of different lengths plus the first chunk of a
prompt split in two; then steps mixing a new prefill (a one-token prompt, then a
6-token one) with running decodes; a seeded sampled sequence preempted and
re-sent whole; finished sequences' blocks reused by a late arrival. Every
sampled row's logits must equal ``transformers``' (float32, atol/rtol 1e-4) and
every token the reference's: ``generate(do_sample=False)`` for greedy rows, our
seeded sampler on ``transformers``' logits for sampled rows (so the noise
depends only on (seed, position), whatever the batch, degree or preemption).

Longer greedy runs, for the checkpoints of ``GREEDY_MODELS`` (the newer families):
32 greedy tokens for each of 8 prompts, once with every prompt alone in its steps
and once 16 sequences (each prompt twice) in one batch, with ``prompt_logprobs``:
every token must be ``transformers``' ``generate``, every sampled row's logits and
every prompt token's log-probability within 1e-4 (float32).

Async scheduling (``--async-scheduling``): the first tiny checkpoint's scenario and the
greedy 16-at-once run again with every decode's token replaced by ``PLACEHOLDER_TOKEN_ID``
(:func:`with_placeholders`): the ranks must feed the tokens they sampled themselves
(rank 0's, sent to the others in one all-reduce at degrees 2 and 4) and report exactly the same tokens and logits.

Degrees 2 and 4 spawn one process per rank over gloo; degree 1 runs in this
process (it makes no collective). All checkpoints of one degree share one
process group. stories260k reproduces its greedy goldens at degrees 1 and 2.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from tests.tiny_models import TINY_MODELS, load_hf_model
from tests.worker.scenarios import SeqSpec, build_plans, hf_reference, standard_specs
from tests.worker.tp_goldens import (
    BLOCK_SIZE,
    GREEDY_BLOCKS,
    GREEDY_PROMPTS,
    GREEDY_SCORED,
    GREEDY_TOKENS,
    NUM_BLOCKS,
    Case,
    _check_case,
    _greedy_reference,
)
from tests.worker.tp_harness import Job, StepRecord, run_jobs
from tpserve.step import PLACEHOLDER_TOKEN_ID, StepPlan

NUM_GOLDEN_LINES = 3
GOLDEN_JOB = "stories260k_goldens"
#: Checkpoints (tests/tiny_models.py) that also run the longer greedy scenarios.
GREEDY_MODELS = ("qwen3_qk_norm",)


def with_placeholders(plans: list[StepPlan]) -> tuple[StepPlan, ...]:
    """The plans as async scheduling sends them: a one-token chunk of a sequence sampled since it was
    (re)admitted feeds ``PLACEHOLDER_TOKEN_ID`` (the token the ranks sampled for it last)."""
    sampled: set[int] = set()
    out = []
    for plan in plans:
        sampled -= {new.seq_id for new in plan.new_seqs} | set(plan.finished_seq_ids)
        chunks = tuple(replace(c, token_ids=(PLACEHOLDER_TOKEN_ID,)) if c.seq_id in sampled and c.num_tokens == 1
                       else c for c in plan.scheduled)
        sampled |= {c.seq_id for c in plan.scheduled if c.sample}
        out.append(replace(plan, scheduled=chunks))
    assert sum(c.token_ids == (PLACEHOLDER_TOKEN_ID,) for plan in out for c in plan.scheduled) > 10
    return tuple(out)


@pytest.fixture(scope="module")
def tiny_cases(tiny_checkpoints: dict[str, Path]) -> dict[str, Case]:
    cases = {}
    for i, spec in enumerate(TINY_MODELS):
        model = load_hf_model(tiny_checkpoints[spec.name])
        specs = standard_specs(model.config.vocab_size, seed=i)
        completions, logits = hf_reference(model, specs)
        plans, expected = build_plans(specs, completions, BLOCK_SIZE, NUM_BLOCKS, seed=i)
        job = Job(spec.name, str(tiny_checkpoints[spec.name]), tuple(plans), NUM_BLOCKS, BLOCK_SIZE)
        cases[spec.name] = Case(job, expected, completions, logits)
        if i == 0:
            cases[f"{spec.name}/async"] = Case(replace(job, name=f"{spec.name}/async", plans=with_placeholders(plans)),
                                               expected, completions, logits)
    return cases


@pytest.fixture(scope="module")
def golden_case(stories_dir: Path, golden_lines: list[dict]) -> Case:
    lines = golden_lines[:NUM_GOLDEN_LINES]
    specs = [
        SeqSpec(i, tuple(line["prompt_token_ids"]), len(line["completion_token_ids"]),
                arrive_step=1 if i == 2 else 0, prefill_chunk=3 if i == 1 else None)
        for i, line in enumerate(lines)
    ]
    completions = {i: list(line["completion_token_ids"]) for i, line in enumerate(lines)}
    plans, expected = build_plans(specs, completions, BLOCK_SIZE, NUM_BLOCKS)
    return Case(Job(GOLDEN_JOB, str(stories_dir), tuple(plans), NUM_BLOCKS, BLOCK_SIZE), expected, completions, None)


@pytest.fixture(scope="module")
def greedy_cases(tiny_checkpoints: dict[str, Path]) -> dict[str, Case]:
    """Per GREEDY_MODELS checkpoint, ``<name>/alone`` and ``<name>/16_at_once`` (module docstring)."""
    cases = {}
    for name in GREEDY_MODELS:
        model = load_hf_model(tiny_checkpoints[name])
        rng = random.Random(19)
        prompts = [tuple(rng.randrange(3, model.config.vocab_size) for _ in range(rng.randrange(2, 13)))
                   for _ in range(GREEDY_PROMPTS)]
        completions, logits, prompt_logprobs = _greedy_reference(model, prompts)
        alone = [SeqSpec(i, prompts[i], GREEDY_TOKENS, GREEDY_SCORED, arrive_step=i * GREEDY_TOKENS)
                 for i in range(GREEDY_PROMPTS)]  # each arrives as the previous one is named finished
        together = [SeqSpec(i, prompts[i % GREEDY_PROMPTS], GREEDY_TOKENS, GREEDY_SCORED)
                    for i in range(2 * GREEDY_PROMPTS)]
        for kind, specs in (("alone", alone), ("16_at_once", together)):
            seq_ids = [spec.seq_id for spec in specs]
            plans, expected = build_plans(specs, {i: completions[i % GREEDY_PROMPTS] for i in seq_ids},
                                          BLOCK_SIZE, GREEDY_BLOCKS, seed=len(specs))
            job = Job(f"{name}/{kind}", str(tiny_checkpoints[name]), tuple(plans), GREEDY_BLOCKS, BLOCK_SIZE)
            cases[job.name] = Case(job, expected, {i: completions[i % GREEDY_PROMPTS] for i in seq_ids},
                                   {i: logits[i % GREEDY_PROMPTS] for i in seq_ids},
                                   {i: prompt_logprobs[i % GREEDY_PROMPTS] for i in seq_ids})
            if kind == "16_at_once":
                name_async = f"{name}/{kind}_async"
                cases[name_async] = replace(cases[job.name], job=replace(job, name=name_async,
                                                                         plans=with_placeholders(plans)))
    return cases


@pytest.fixture(scope="module")
def records_at(tiny_cases: dict[str, Case], golden_case: Case, greedy_cases: dict[str, Case]):
    """``records_at(tp)``: rank 0's records of every case at degree ``tp``, run once per degree."""
    cache: dict[int, dict[str, list[StepRecord]]] = {}

    def run(tp: int) -> dict[str, list[StepRecord]]:
        if tp not in cache:
            jobs = [case.job for case in (*tiny_cases.values(), *greedy_cases.values())]
            if tp in (1, 2):
                jobs.append(golden_case.job)
            cache[tp] = run_jobs(jobs, tp_size=tp)
        return cache[tp]

    return run


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", [spec.name for spec in TINY_MODELS] + [f"{TINY_MODELS[0].name}/async"])
def test_tiny_model_matches_transformers(tp: int, name: str, records_at, tiny_cases: dict[str, Case]) -> None:
    _check_case(tiny_cases[name], records_at(tp)[name])


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind", ["alone", "16_at_once", "16_at_once_async"])
@pytest.mark.parametrize("name", GREEDY_MODELS)
def test_greedy_runs_match_transformers(tp: int, kind: str, name: str, records_at,
                                        greedy_cases: dict[str, Case]) -> None:
    case = greedy_cases[f"{name}/{kind}"]
    largest_batch = max(len(plan.scheduled) for plan in case.job.plans)
    assert largest_batch == (1 if kind == "alone" else 2 * GREEDY_PROMPTS)
    _check_case(case, records_at(tp)[case.job.name])


@pytest.mark.parametrize("tp", [1, 2])
def test_stories260k_reproduces_goldens(tp: int, records_at, golden_case: Case) -> None:
    _check_case(golden_case, records_at(tp)[GOLDEN_JOB])


def test_scenario_covers_the_contract(tiny_cases: dict[str, Case]) -> None:
    """The plans really contain what the module docstring promises (guards the test itself)."""
    plans = next(iter(tiny_cases.values())).job.plans
    first = plans[0]
    assert len({c.num_tokens for c in first.scheduled}) == len(first.scheduled) > 2  # several prefill lengths
    assert any(not c.sample for c in first.scheduled)  # a prompt's first chunk
    mixed = [p for p in plans if p.new_seqs and any(c.num_tokens == 1 for c in p.scheduled if c.start_position)]
    assert mixed  # a new prefill next to running decodes
    assert any(set(p.finished_seq_ids) & {n.seq_id for n in p.new_seqs} for p in plans)  # preemption
    used = [b for p in plans for c in p.scheduled for b in c.new_block_ids]
    assert len(used) > len(set(used))  # freed blocks were reused
