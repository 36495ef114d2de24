"""Stand-in worker groups and constants shared by the coordinator's engine tests (no processes, no torch)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from collections.abc import Sequence as SequenceOf
from typing import Any

from coordinator.block_allocator import BlockAllocator
from coordinator.engine import Engine
from coordinator.metrics import Metrics
from coordinator.scheduler import Scheduler
from coordinator.sequence import Sequence, StopParams
from coordinator.tokenizer import Tokenizer
from coordinator.validation import GenerateParams
from coordinator.worker_client import WorkerGroupError
from tpserve.embedded_model import default_model_dir
from tpserve.step import PLACEHOLDER_TOKEN_ID, SampleLogprobs, SamplingParams, StepPlan, StepResult
from worker.multi_step import run_steps  # the ranks' expansion of a multi-step plan (no torch)

# " the cat sat on the mat and ran away" in the embedded model's vocabulary (no eos among them).
SCRIPT = [315, 322, 344, 365, 973, 619, 322, 357, 365, 352, 844, 318, 994]
PROMPT = [1, 5, 6, 8, 9, 10, 11, 12, 13, 14]  # 2.5 blocks of 4: samples of one request share two
VOCAB_SIZE, MAX_MODEL_LEN = 1024, 4096


def scripted(script: SequenceOf[int] = SCRIPT) -> Callable[[int, int], int]:
    """Token sampler for :class:`FakeRankGroup`: a sequence's k-th sample is ``script[k % len(script)]``."""
    return lambda k, step: script[k % len(script)]


def constant(token: int) -> Callable[[int, int], int]:
    """Token sampler for :class:`FakeRankGroup`: every sample is ``token``."""
    return lambda k, step: token


class PagedCacheModel:
    """A simulated model over a simulated paged KV cache, for :class:`FakeRankGroup` (``model=``).

    It keeps the ranks' bookkeeping, not canned tokens: a paged "KV cache" of token ids (block id
    -> slot -> the token written there) and per-sequence block tables from the plans; it resolves
    ``PLACEHOLDER_TOKEN_ID`` to the token it sampled for the sequence in the step before (as
    worker/placeholders.py does), and samples each sequence's next token as ``next_token`` of *every
    token its block table holds* at positions ``0 .. p``. A token fed at the wrong position, a
    placeholder resolved to the wrong token, a block reused while a step in flight still wrote it,
    or a stale prefix-cache hit all change the tokens that follow; the reference is ``next_token``
    applied to the prompt alone, with no engine, scheduler or blocks.

    Records: ``tables`` (seq id -> block table), ``samples`` (seq id -> tokens sampled, wasted ones
    included), ``num_placeholders`` fed, ``num_multi_step_plans`` run.
    """

    def __init__(self, block_size: int, next_token: Callable[[list[int]], int]) -> None:
        self.block_size, self.next_token = block_size, next_token
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> token id written there
        self.tables: dict[int, list[int]] = {}  # seq id -> block table
        self.last_token: dict[int, int] = {}  # seq id -> token sampled last
        self.samples: dict[int, int] = {}  # seq id -> tokens sampled for it (wasted ones included)
        self.num_placeholders = 0
        self.num_multi_step_plans = 0

    def execute(self, plan: StepPlan) -> list[int]:
        """Apply ``plan`` to the cache as the ranks would; the tokens its sampling chunks sample, in order
        (a multi-step plan's: each chunk's ``num_steps`` in a row, run as the ranks' worker/multi_step.py does)."""
        if plan.num_steps > 1:
            self.num_multi_step_plans += 1
            return list(run_steps(plan, lambda step: StepResult(step.step_id, tuple(self._execute(step))))
                        .sampled_token_ids)
        return self._execute(plan)

    def _execute(self, plan: StepPlan) -> list[int]:
        for seq_id in plan.finished_seq_ids:
            self.tables.pop(seq_id, None)
            self.last_token.pop(seq_id, None)
        for seq_id, num_blocks in plan.trimmed_block_tables:
            del self.tables[seq_id][num_blocks:]
        for new in plan.new_seqs:
            self.tables[new.seq_id] = []
        tokens = []
        for chunk in plan.scheduled:
            table = self.tables[chunk.seq_id]
            table.extend(chunk.new_block_ids)
            fed = list(chunk.token_ids)
            if fed == [PLACEHOLDER_TOKEN_ID]:
                fed = [self.last_token[chunk.seq_id]]
                self.num_placeholders += 1
            assert PLACEHOLDER_TOKEN_ID not in fed, f"step {plan.step_id}: a placeholder inside {chunk}"
            for offset, token in enumerate(fed):
                self.slots[self._slot(table, chunk.start_position + offset)] = token
            if chunk.sample:
                end = chunk.start_position + len(fed)
                token = self.next_token([self.slots[self._slot(table, p)] for p in range(end)])
                self.last_token[chunk.seq_id] = token
                self.samples[chunk.seq_id] = self.samples.get(chunk.seq_id, 0) + 1
                tokens.append(token)
        return tokens

    def _slot(self, table: list[int], position: int) -> tuple[int, int]:
        return table[position // self.block_size], position % self.block_size


class FakeRankGroup:
    """A stand-in for coordinator/worker_client.py's WorkerGroup: no processes, the steps run as tasks.

    Every option is a keyword:

    - ``sample(k, step)``: the token for a sequence's k-th sample (from 0) in the group's ``step``-th step
      (from 1); default: SCRIPT in order for each sequence (:func:`scripted`).
    - ``step_s`` / ``first_step_s``: seconds a step takes (the first ones, until a sequence was seen: the
      latter); ``grammar_s``: seconds rank 0 takes to build a grammar.
    - ``model_execute_s`` / ``wait_s``: the timings each StepResult reports.
    - ``logprobs``: each sample's logprob is -0.25 (its token the only candidate).
    - ``fail_at``: step numbers (from 1) that raise WorkerGroupError(``"step N: rank {fail_rank} is gone"``)
      after their ``step_s``.
    - ``poison_token``: a step scheduling a sequence that was ever fed this token fails as ``fail_at``'s do
      (a request that breaks the group whatever it is batched with).
    - ``scheduler``: whose invariants are checked as each plan is submitted (no step in flight then).
    - ``model``: a :class:`PagedCacheModel` that samples instead of ``sample``; the steps then run strictly
      in the order they were sent, as the ranks run them, and each one's end is an event ("done", step id).

    Records: ``plans`` and ``events`` ("submit", step id) as submitted; ``steps`` run; ``sampled`` (seq id ->
    tokens sampled); ``seen`` sequences; ``in_flight`` (step id -> its seq ids), ``max_in_flight`` and
    ``overlaps`` ((step id, seq id) scheduled while in another step in flight). ``on_submit(plan)`` is a hook.
    Plans must arrive in step order (asserted). Subclasses may override ``_run``.
    """

    def __init__(self, *, sample: Callable[[int, int], int] | None = None, step_s: float = 0.0,
                 first_step_s: float | None = None, grammar_s: float = 0.0, model_execute_s: float = 0.0,
                 wait_s: float = 0.0, logprobs: bool = False, fail_at: Collection[int] = frozenset(),
                 fail_rank: int = 1, poison_token: int | None = None, scheduler: Scheduler | None = None,
                 model: PagedCacheModel | None = None) -> None:
        self.sample = sample or scripted()
        self.step_s, self.grammar_s = step_s, grammar_s
        self.first_step_s = step_s if first_step_s is None else first_step_s
        self.model_execute_s, self.wait_s, self.logprobs = model_execute_s, wait_s, logprobs
        self.fail_at, self.fail_rank, self.scheduler = set(fail_at), fail_rank, scheduler
        self.poison_token, self.poisoned = poison_token, set[int]()  # the sequences fed it
        self.plans: list[StepPlan] = []
        self.events: list[tuple[str, int]] = []
        self.steps = 0
        self.sampled: dict[int, int] = {}  # seq id -> tokens sampled for it so far
        self.seen: set[int] = set()
        self.in_flight: dict[int, frozenset[int]] = {}  # step id -> its sequences
        self.max_in_flight = 0
        self.overlaps: list[tuple[int, int]] = []
        self.last_step = -1
        self.on_submit: Callable[[StepPlan], None] = lambda plan: None
        self.model = model
        self._previous: asyncio.Future[None] | None = None  # the step sent last (in-order runs only)

    async def submit(self, plan: StepPlan) -> asyncio.Future[StepResult]:
        """The engine's dispatch (WorkerGroup.submit): the step runs in the background."""
        if self.scheduler is not None:
            self.scheduler.check_invariants()
        assert plan.step_id > self.last_step, f"step {plan.step_id} sent after step {self.last_step}"
        self.last_step = plan.step_id
        self.plans.append(plan)
        self.events.append(("submit", plan.step_id))
        self.on_submit(plan)
        if self.model is None:
            return asyncio.ensure_future(self._run(plan))
        previous, self._previous = self._previous, asyncio.get_running_loop().create_future()
        return asyncio.ensure_future(self._run_in_order(plan, previous, self._previous))

    async def _run_in_order(self, plan: StepPlan, previous: asyncio.Future[None] | None,
                            done: asyncio.Future[None]) -> StepResult:
        try:
            if previous is not None:
                await asyncio.shield(previous)  # the ranks run plans in the order they were sent
            return await self._run(plan)
        finally:
            done.set_result(None)

    async def execute(self, plan: StepPlan) -> StepResult:
        return await (await self.submit(plan))

    async def prepare_grammar(self, grammar: str) -> None:
        await asyncio.sleep(self.grammar_s)

    def _scripted(self, plan: StepPlan, step: int) -> list[int]:
        """The tokens ``sample`` gives the plan's sampling chunks, in order."""
        tokens = []
        for chunk in plan.scheduled:
            if chunk.sample:
                index = self.sampled.get(chunk.seq_id, 0)
                self.sampled[chunk.seq_id] = index + 1
                tokens.append(self.sample(index, step))
        return tokens

    async def _run(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        step = self.steps
        ids = frozenset(c.seq_id for c in plan.scheduled)
        self.overlaps += [(plan.step_id, s) for other in self.in_flight.values() for s in ids & other]
        self.in_flight[plan.step_id] = ids
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        try:
            await asyncio.sleep(self.step_s if self.seen else self.first_step_s)
            self.poisoned.update(c.seq_id for c in plan.scheduled if self.poison_token in c.token_ids)
            if step in self.fail_at or ids & self.poisoned:
                raise WorkerGroupError(f"step {plan.step_id}: rank {self.fail_rank} is gone")
            if self.model is not None:
                tokens = self.model.execute(plan)
                self.events.append(("done", plan.step_id))
            else:
                tokens = self._scripted(plan, step)
            self.seen.update(c.seq_id for c in plan.scheduled)
        finally:
            del self.in_flight[plan.step_id]
        logprobs = tuple(SampleLogprobs(i, -0.25, (t,), (-0.25,)) for i, t in enumerate(tokens)) \
            if self.logprobs else ()
        return StepResult(plan.step_id, tuple(tokens), logprobs, model_execute_time_s=self.model_execute_s,
                          wait_time_s=self.wait_s)


def make_engine(*, group: FakeRankGroup, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                max_num_batched_tokens: int = 64, max_model_len: int = 128, max_queue_len: int = 16,
                tokenizer: Tokenizer | None = None, metrics: Metrics | None = None,
                scheduler: Scheduler | None = None, **engine_options: Any) -> Engine:
    """A real engine over ``group``: a scheduler of ``num_blocks`` blocks of ``block_size`` tokens (or the
    ``scheduler`` given), the embedded model's tokenizer unless one is given; ``engine_options`` are the
    Engine's keywords (on_group_failure, micro_batches, stream_interval, on_fatal)."""
    if scheduler is None:
        scheduler = Scheduler(BlockAllocator(num_blocks, block_size), max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens)
    return Engine(scheduler, group, tokenizer or Tokenizer.from_pretrained(default_model_dir()), max_model_len,
                  max_queue_len, metrics or Metrics(), **engine_options)


def make_params(*, prompt: SequenceOf[int] = (1, 5, 6, 8), max_tokens: int, request_id: str = "",
                temperature: float = 0.0, stop: tuple[str, ...] = (), ignore_eos: bool = True,
                **sampling: Any) -> GenerateParams:
    """A validated request (coordinator/validation.py GenerateParams): greedy and ignoring eos unless told;
    ``sampling`` are further SamplingParams fields (logprobs, seed, ...)."""
    return GenerateParams(request_id, list(prompt), max_tokens, SamplingParams(temperature=temperature, **sampling),
                          stop, frozenset(), ignore_eos)


EOS = 2


def make_seq(seq_id: int, prompt: list[int], max_tokens: int, max_model_len: int = 96,
             sampling: SamplingParams | None = None) -> Sequence:
    return Sequence(seq_id, list(prompt), sampling or SamplingParams(temperature=0.0),
                    StopParams(max_tokens, frozenset({EOS})), max_model_len)
