"""The engine loop: schedule, execute, update, detokenize, stream.

Data flow of one step (all on the coordinator's event loop, so no locks):

    Scheduler.schedule() -> StepPlan -> WorkerGroup.submit(plan) -> StepResult
    -> Scheduler.update(plan, result) -> TokenOutput per sampled token
    -> per request: IncrementalDetokenizer -> StopStringMatcher -> RequestOutput
       onto the request's queue, read by its gRPC handler. With speculative
       decoding a step may give a request several tokens: they go out in one
       RequestOutput, cut at the first stop (token, length or stop string).

The ranks never wait for the per-request work (issue 26): when step t's result
arrives the loop applies it to the scheduler (token bookkeeping, token-level stops),
plans and dispatches step t+1, and only then detokenizes and streams step t while
the ranks run t+1 (coordinator/inflight_step.py). A sequence that a stop string, a
cancel or an abort ends meanwhile is in t+1's plan: its token from t+1 is dropped
(``Scheduler.update`` skips a finished sequence) and the plan after names it to the
workers. Its blocks are freed at once; a later plan may give them to another
sequence, but the ranks run plans in the order sent, so every step that still
writes them for the finished sequence has run before that plan's does.

With async scheduling (``--async-scheduling``) the loop keeps one more step in
flight: t+1 is planned and sent before t's result arrives (the scheduler counts a
planned sample as pending; the ranks feed their own sampled token in its place), and
when t's result is in, the loop applies it, sends t+2 and then streams t, so a rank
that ends a step finds the next plan waiting. A sequence that t's token stops is in
t+1 and possibly t+2; their tokens for it are dropped like any finished sequence's.

Requests join the running batch at the next step and leave it the step they finish.
A handler that stops listening (client cancel, deadline) aborts its request, which
frees its blocks at once. A worker failure fails every request in flight and marks
the engine dead. No torch.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field

import structlog

from coordinator.admission import check_admissible, prepare_grammar
from coordinator.detokenizer import IncrementalDetokenizer
from coordinator.engine_state import EngineState, check_transition
from coordinator.errors import DeadlineExceededError, InvalidArgumentError, TpserveError
from coordinator.inflight_step import InFlightStep
from coordinator.logprobs import prompt_token_logprobs, token_logprob
from coordinator.metrics import Metrics
from coordinator.output_collector import RequestOutputCollector
from coordinator.request_output import RequestOutput, aborted_output
from coordinator.request_table import RequestAborted, RequestEntry, RequestTable
from coordinator.request_timeline import stamp_timings, trace_unfinished
from coordinator.micro_batches import run_micro_batches
from coordinator.scheduler import Scheduler, TokenOutput
from coordinator.sequence import FinishReason, Sequence, StopParams
from coordinator.stop_strings import StopStringMatcher
from coordinator.tokenizer import Tokenizer
from coordinator.validation import GenerateParams
from coordinator.worker_client import WorkerGroup, WorkerGroupError
from tpserve.step import StepPlan

log = structlog.get_logger(__name__)


@dataclass(slots=True, eq=False)
class _RequestState:
    request_id: str
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    arrival_time: float
    tenant: str = ""
    queue: RequestOutputCollector = field(default_factory=RequestOutputCollector)
    first_token_time: float | None = None


class Engine:
    """Runs continuous batching for one worker group.

    Args:
        scheduler: owns sequences and KV blocks.
        workers: the tensor-parallel group, already started.
        tokenizer: the model's tokenizer.
        max_model_len: longest sequence in tokens.
        max_queue_len: most requests waiting for admission.
        metrics: Prometheus metrics to update.
        on_fatal: called once when the worker group fails.
        on_group_failure: called with the reason when a step fails; returns True when
            the group is being restarted (the caller then calls :meth:`suspend` and
            later :meth:`resume`), False to fail every request.
        micro_batches: steps in flight at once (pipeline stages).
        stream_interval: tokens a stream's handler waits for before it is woken (the first
            output and the last go at once): coordinator/output_collector.py.
    """

    def __init__(self, scheduler: Scheduler, workers: WorkerGroup, tokenizer: Tokenizer, max_model_len: int,
                 max_queue_len: int, metrics: Metrics, on_fatal: Callable[[str], None] = lambda _: None,
                 on_group_failure: Callable[[str], bool] = lambda _: False, micro_batches: int = 1,
                 stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        self.scheduler = scheduler
        self.stream_interval = stream_interval
        self.micro_batches = micro_batches  # steps in flight: the pipeline's stages (coordinator/micro_batches.py)
        # Steps in flight beyond the one whose result is awaited: 1 under async scheduling.
        self._depth = 2 if scheduler.async_scheduling else 1
        self.workers = workers
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_queue_len = max_queue_len
        self.metrics = metrics
        self._on_fatal = on_fatal
        self.requests = RequestTable()  # every request from its receipt, by id: Abort's table
        self.requests.on_unfinished = trace_unfinished
        self._states: dict[int, _RequestState] = {}
        self._seq_ids = itertools.count()
        self._wakeup = asyncio.Event()
        self._prefix_cache_counted = (0, 0)  # scheduler's queries and hits already added to the metrics
        self._spec_counted = scheduler.spec.snapshot()  # speculative decoding counters already added
        self._on_group_failure = on_group_failure
        self.state = EngineState.SERVING
        self._reason: str | None = None  # why the engine is RECOVERING or DEAD
        self._state_changed = asyncio.Event()  # wakes a loop waiting in RECOVERING
        # A step's outputs between Scheduler.update and their processing, which waits for the next
        # plan to be sent (an await): an explicit Abort meanwhile streams its request's first.
        self._unstreamed: list[TokenOutput] = []
        scheduler.on_preempt = self._preempted

    # -- the life cycle (coordinator/engine_state.py) --------------------------------

    @property
    def dead(self) -> str | None:
        """Why the worker group failed for good; None while it is not DEAD."""
        return self._reason if self.state is EngineState.DEAD else None

    @property
    def recovering(self) -> str | None:
        """Why the worker group is being restarted; None while it is not RECOVERING."""
        return self._reason if self.state is EngineState.RECOVERING else None

    @property
    def draining(self) -> bool:
        return self.state is EngineState.DRAINING

    def _enter(self, state: EngineState, reason: str | None = None) -> None:
        check_transition(self.state, state)
        log.debug("engine state", old=self.state.value, new=state.value)
        self.state, self._reason = state, reason
        self._state_changed.set()
        self._wakeup.set()

    def drain(self) -> None:
        """Refuse new requests; those in flight run to their end. A no-op while the group is
        restarting or down (new requests are refused then anyway; a draining server does not
        restart its group)."""
        if self.state in (EngineState.SERVING, EngineState.RESUMED):
            self._enter(EngineState.DRAINING)

    # -- requests --------------------------------------------------------------------

    async def generate(self, params: GenerateParams, timeout_s: float | None = None,
                       stream_interval: int | None = None,
                       entry: RequestEntry | None = None) -> AsyncIterator[RequestOutput]:
        """Adds a request and yields its outputs until it finishes.

        Outputs produced while the caller had not taken the previous one arrive merged into
        one; ``stream_interval`` (default: the engine's; :data:`UNARY` for a caller that
        wants only the end) holds them back until that many tokens are pending
        (coordinator/output_collector.py).

        ``entry`` is the request as its handler registered it on receipt
        (:attr:`requests`; every sample of an ``n`` > 1 request shares it); None registers
        it here. An Abort of its id ends it wherever it is: one that came before it was
        queued (while rank 0 built its grammar, or before an ``n`` > 1 request's sample
        started) gives one output, with no token and finish_reason ABORT.

        Leaving the iteration early (the client cancelled) aborts the request and frees its KV
        blocks. A structured-output request is queued once rank 0 has built its grammar
        (coordinator/admission.py); the last output carries the timings (request_timeline.py).

        Raises:
            UnavailableError: draining, or the worker group is down.
            ResourceExhaustedError: the queue is full, or the request can never fit in the KV cache.
            DeadlineExceededError: ``timeout_s`` seconds passed before it finished.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        own_entry = entry is None
        entry = self.requests.open(params.request_id, params.tenant) if entry is None else entry
        state, timer = None, None
        try:
            if params.sampling.grammar and self.state in (EngineState.SERVING, EngineState.RESUMED):
                await entry.unless_aborted(prepare_grammar(self.workers, params.sampling.grammar, deadline, timeout_s, entry))
            if entry.aborted:
                raise RequestAborted(entry.request_id)
            state = self._add(params, self.stream_interval if stream_interval is None else stream_interval, entry)
            # One timer per request, not one per output (asyncio.wait_for wraps every get in a task).
            timer = None if deadline is None else asyncio.get_running_loop().call_later(
                max(deadline - time.monotonic(), 0.0), state.queue.put_nowait,
                DeadlineExceededError(f"request {state.request_id}: deadline of {timeout_s:.3f} s exceeded"))
            while True:
                output = await state.queue.get()  # raises the error put (deadline, failure)
                yield output if output.finish_reason is None else stamp_timings(output, entry, state)
                if output.finish_reason is not None:
                    return
        except RequestAborted:  # before it was queued: nothing of it ran
            yield stamp_timings(aborted_output(entry.request_id, len(params.prompt_token_ids)), entry, None)
        finally:
            if timer is not None:
                timer.cancel()
            if state is not None:
                self._abort(state)
            if own_entry:
                self.requests.close(entry)

    def admit(self, params: GenerateParams, entry: RequestEntry) -> None:
        """Admits all ``entry.num_samples`` samples of a request at once (``n`` > 1): their queue
        places are held until each is queued (:meth:`generate` with ``entry``), so none is
        refused once another has streamed.

        Raises:
            UnavailableError, ResourceExhaustedError: as :meth:`generate`, for the whole request.
        """
        check_admissible(self.state, self._reason, params, self.scheduler, self.max_model_len)
        self.requests.reserve(entry, self.scheduler.waiting, self.max_queue_len)

    def _add(self, params: GenerateParams, stream_interval: int, entry: RequestEntry) -> _RequestState:
        held = self.requests.take_reservation(entry)  # admitted with its request's other samples
        check_admissible(self.state, self._reason, params, self.scheduler, self.max_model_len, admitted=held)
        if not held:
            self.requests.check_queue(1, self.scheduler.waiting, self.max_queue_len)
        seq_id = next(self._seq_ids)
        request_id = entry.request_id
        seq = Sequence(
            seq_id=seq_id,
            prompt_token_ids=list(params.prompt_token_ids),
            sampling=params.sampling,
            stop=StopParams(params.max_tokens, self.tokenizer.eos_token_ids, params.stop_token_ids, params.ignore_eos),
            max_model_len=self.max_model_len,
            cache_namespace=params.cache_namespace,
            priority=params.priority,
            # A continued request (another replica's earlier output) starts where a sequence
            # resumed by recompute does: its output kept, nothing computed (scheduler.reset_workers).
            output_token_ids=list(params.generated_token_ids),  # usage counts them as prompt tokens
        )
        state = _RequestState(request_id, seq, IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids),
                              StopStringMatcher(params.stop, params.include_stop_str_in_output), time.monotonic(),
                              params.tenant, RequestOutputCollector(stream_interval))
        for token_id in params.generated_token_ids:  # text the caller has: replayed, so stop strings span the seam
            if state.stop_matcher.push(state.detokenizer.step(token_id))[1]:
                raise InvalidArgumentError(f"request {request_id}: the text of generated_token_ids contains a stop "
                                           "string; that completion had ended")
        self._states[seq_id] = state
        entry.samples.append(state)
        self.scheduler.add(seq)
        self.metrics.prompt_tokens.inc(seq.num_usage_prompt_tokens)
        self._wakeup.set()
        return state

    def _preempted(self, seq: Sequence) -> None:
        """Counts and logs a preemption (sizes and ids only: no token of the request reaches the log)."""
        self.metrics.num_preemptions.inc()
        state = self._states.get(seq.seq_id)
        log.info("request preempted", request_id=state.request_id if state else None, seq_id=seq.seq_id,
                 num_tokens=seq.num_tokens, num_preemptions=seq.num_preemptions,
                 num_running=len(self.scheduler.running), num_free_blocks=self.scheduler.allocator.num_free_blocks)

    def _abort(self, state: _RequestState) -> None:
        """Forgets a request; frees its blocks if it has not finished (cancel, deadline)."""
        if self._states.pop(state.seq.seq_id, None) is None:
            return
        if not state.seq.is_finished:
            self.scheduler.finish(state.seq, FinishReason.ABORT)
            log.info("request aborted", request_id=state.request_id)  # counted as any finished (issue 11)
            self._observe_finished(state, time.monotonic(), FinishReason.ABORT)
        self._update_gauges()

    def abort_request(self, request_id: str, tenant: str | None = None) -> int:
        """:meth:`abort_requests` of one id."""
        return self.abort_requests((request_id,), tenant)

    def abort_requests(self, request_ids: Collection[str], tenant: str | None = None) -> int:
        """Ends every request named in ``request_ids`` now (an explicit Abort), wherever it is:
        validating, waiting for its grammar, queued, running, or an ``n`` > 1 request whose
        later samples have not started. Queued samples' blocks are freed at once; every
        sample's stream ends with finish_reason ABORT. One look-up per id
        (coordinator/request_table.py), whatever else is in flight.

        Args:
            request_ids: the callers' request ids (every sample of an ``n`` > 1 request has its request's).
            tenant: only requests of this tenant (API keys on); None: any request.

        Returns:
            How many samples were ended (0: none in flight; a request aborted before its
            samples were queued counts its ``n``).

        Raises:
            InvalidArgumentError: more than MAX_ABORT_IDS ids (coordinator/request_table.py).
        """
        entries = self.requests.abort(request_ids, tenant)
        num_aborted = sum(entry.num_samples - len(entry.samples) for entry in entries)  # end before they start
        states = [state for entry in entries for state in entry.samples if state.seq.seq_id in self._states]
        now = time.monotonic()
        if states and self._unstreamed:  # their last step's tokens come first
            seq_ids = {state.seq.seq_id for state in states}
            self._process([out for out in self._unstreamed if out.seq.seq_id in seq_ids])
            self._unstreamed = [out for out in self._unstreamed if out.seq.seq_id not in seq_ids]
        for state in states:
            seq = state.seq
            if seq.is_finished:
                continue
            self.scheduler.finish(seq, FinishReason.ABORT)
            self._observe_finished(state, now, FinishReason.ABORT)
            state.queue.put_nowait(RequestOutput(state.request_id, "", [], FinishReason.ABORT, seq.num_usage_prompt_tokens,
                                                 seq.num_usage_completion_tokens, seq.num_cached_prompt_tokens or 0))
            num_aborted += 1
        if entries:
            log.info("request aborted by the caller", request_ids=[entry.request_id for entry in entries[:8]],
                     num_requests=len(entries), num_aborted=num_aborted)
            self._update_gauges()
        return num_aborted

    # -- the loop ----------------------------------------------------------------------

    async def run(self) -> None:
        """Steps while there is work, sleeps while there is none, until cancelled or the group fails.

        A bug that escapes a step fails every request in flight (INTERNAL) rather than
        leaving them waiting for a loop that no longer runs.
        """
        try:
            await self._loop()
        except Exception as exc:  # noqa: BLE001 - no request may hang on a dead loop
            log.exception("engine loop failed")
            self.fail_all(f"engine loop failed: {type(exc).__name__}: {exc}")

    async def _loop(self) -> None:
        if self.micro_batches > 1:  # pipeline stages: up to one step in flight per stage
            await run_micro_batches(self, self.micro_batches)
            return
        in_flight: deque[InFlightStep] = deque()  # dispatched, results not taken yet, oldest first
        try:
            while True:
                if not in_flight:
                    if self.state is EngineState.DEAD:
                        return  # the restart failed, or a step failed twice: every request has its error
                    if not self.state.runs_steps:
                        self._state_changed.clear()
                        await self._state_changed.wait()  # RECOVERING: until resume() or fail_all()
                        continue
                    plan = self._plan()
                    if plan is None:
                        self.metrics.end_busy_window()
                        self._wakeup.clear()
                        await self._wakeup.wait()
                        continue
                    in_flight.append(await InFlightStep.dispatch(self.workers, plan, follows_step=False))
                await self._dispatch_ahead(in_flight)  # async scheduling: step t+1 before t's result
                await self._complete(in_flight)
        finally:
            for step in in_flight:
                step.cancel()  # cancelled (shutdown) while steps ran

    def _plan(self) -> StepPlan | None:
        """The next step's plan; None when there is nothing to run or nothing fits (until a
        running request finishes or a new one arrives: admission guarantees one will fit)."""
        if not (self.scheduler.running or self.scheduler.waiting):
            return None
        plan = self.scheduler.schedule()
        if plan.scheduled:
            return plan
        self.scheduler.take_back(plan)  # its drops and trims go with the next plan
        return None

    async def _dispatch_ahead(self, in_flight: deque[InFlightStep]) -> None:
        """Tops the steps in flight up to the loop's depth: one more than the step whose result
        is awaited next under async scheduling (the ranks find their next plan queued when a
        step ends), none otherwise."""
        while in_flight and len(in_flight) < self._depth and self.state.runs_steps \
                and in_flight[-1].workers is self.workers:
            plan = self._plan()
            if plan is None:
                return
            in_flight.append(await InFlightStep.dispatch(self.workers, plan, follows_step=True))

    async def _complete(self, in_flight: deque[InFlightStep]) -> None:
        """Takes the oldest step's result, dispatches the next step, then streams the step's tokens
        while the ranks run what is in flight. Leaves the steps still in flight in ``in_flight``."""
        step = in_flight.popleft()
        try:
            result = await step.result()
        except WorkerGroupError as exc:
            self._drop(in_flight)  # later steps of a failed group are void
            if step.workers is not self.workers:
                return  # a step of the lost group, which was replaced meanwhile: nothing to report
            # A step that fails again on a freshly restarted group would fail every
            # time (a bad plan, a broken checkpoint): give up rather than loop.
            if self.state is EngineState.RESUMED or not self._on_group_failure(str(exc)):
                self.fail_all(f"the worker group failed: {exc}")
            return  # or a restart re-queued every sequence: the plan's work is redone
        received = time.perf_counter()
        if not self.state.runs_steps or step.workers is not self.workers:
            self._drop(in_flight)
            return  # the group was declared lost during this step: its result is void
        if self.state is EngineState.RESUMED:
            self._enter(EngineState.SERVING)
        self._unstreamed = self.scheduler.update(step.plan, result)
        if not in_flight:
            plan = self._plan()
            if plan is not None:
                in_flight.append(await InFlightStep.dispatch(self.workers, plan, follows_step=True))
        await self._dispatch_ahead(in_flight)
        outputs, self._unstreamed = self._unstreamed, []
        if self.state is not EngineState.DEAD:  # (fail_all, meanwhile, gave every request its error)
            self._process(outputs)
        if result.expert_token_counts:
            self.metrics.add_expert_tokens(result.expert_token_counts)
        self._update_gauges()
        self.metrics.observe_step(step.plan.num_tokens, received - step.dispatched_at, result.model_execute_time_s,
                                  result.wait_time_s if step.follows_step else None, received, time.perf_counter())

    @staticmethod
    def _drop(in_flight: deque[InFlightStep]) -> None:
        """Gives up on every step in flight (their group failed or was replaced)."""
        while in_flight:
            in_flight.popleft().cancel()

    def _process(self, outputs: list[TokenOutput]) -> None:
        """Turns a step's tokens into one RequestOutput per request (a sequence's tokens are adjacent)."""
        now = time.monotonic()
        start, num_outputs = 0, len(outputs)
        while start < num_outputs:
            seq = outputs[start].seq
            end = start + 1
            while end < num_outputs and outputs[end].seq is seq:  # several only with speculative decoding
                end += 1
            self._process_request(outputs[start:end], now)
            start = end

    def _process_request(self, outs: list[TokenOutput], now: float) -> None:
        """One step's tokens of one request (several with speculative decoding) -> one RequestOutput."""
        seq = outs[0].seq
        state = self._states.get(seq.seq_id)
        if state is None:
            return
        prompt_logprobs: tuple = ()
        if state.first_token_time is None:
            state.first_token_time = now
            self.metrics.time_to_first_token.observe(now - state.arrival_time)
            if seq.sampling.prompt_logprobs is not None:
                prompt_logprobs = prompt_token_logprobs(self.tokenizer, seq.prompt_token_ids, seq.prompt_logprobs)
        if len(outs) == 1 and outs[0].finish_reason is None and outs[0].logprobs is None:
            # The common case, one token mid-sequence without logprobs (issue 26, per-token
            # cost): what the loop below does for it, without the loop.
            token_id = outs[0].token_id
            text, matched = state.stop_matcher.push(state.detokenizer.step(token_id))
            finish = None
            if matched:
                self.scheduler.finish(seq, FinishReason.STOP)
                finish = FinishReason.STOP
                self._observe_finished(state, now, finish)
            state.queue.put_nowait(RequestOutput(state.request_id, text, [token_id], finish, seq.num_usage_prompt_tokens,
                                                 seq.num_usage_completion_tokens, seq.num_cached_prompt_tokens or 0, (),
                                                 prompt_logprobs))
            return
        text, token_ids, logprobs, finish = "", [], [], None
        for index, out in enumerate(outs):
            finish, matched = out.finish_reason, False
            if not (finish is FinishReason.STOP and seq.is_stop_token(out.token_id)):  # a stop token is not returned
                token_ids.append(out.token_id)
                if out.logprobs is not None:
                    logprobs.append(token_logprob(self.tokenizer, out.token_id, out.logprobs))
                delta, matched = state.stop_matcher.push(state.detokenizer.step(out.token_id))
                text += delta
                if matched:
                    self.scheduler.finish(seq, FinishReason.STOP)
                    # Tokens after the stop string's (a multi-token step) were never returned: usage omits them.
                    seq.truncate_output(seq.num_output_tokens - (len(outs) - 1 - index))
                    finish = FinishReason.STOP
            if finish is not None and not matched:
                tail, matched = state.stop_matcher.push(state.detokenizer.flush())
                text += tail if matched else tail + state.stop_matcher.flush()
                if matched:
                    finish = FinishReason.STOP
            if finish is not None:
                break
        if finish is not None:
            self._observe_finished(state, now, finish)
        state.queue.put_nowait(RequestOutput(state.request_id, text, token_ids, finish,
                                             seq.num_usage_prompt_tokens, seq.num_usage_completion_tokens,
                                             seq.num_cached_prompt_tokens or 0, tuple(logprobs), prompt_logprobs))

    def _observe_finished(self, state: _RequestState, now: float, reason: FinishReason) -> None:
        seq = state.seq
        self.metrics.request_success.labels(finished_reason=reason.value).inc()
        self.metrics.generation_tokens.inc(num_generated := seq.num_usage_completion_tokens)  # not a continuation's
        self.metrics.e2e_request_latency.observe(now - state.arrival_time)
        if num_generated > 1 and state.first_token_time is not None:
            self.metrics.time_per_output_token.observe((now - state.first_token_time) / (num_generated - 1))

    def suspend(self, reason: str) -> int:
        """The worker group is lost and being restarted: hold every request, refuse new ones.

        Running sequences go back to the queue to be recomputed on the new group
        (:meth:`Scheduler.reset_workers`); their clients see a pause, then the rest
        of their streams. Returns the number of sequences that will resume.
        """
        self._enter(EngineState.RECOVERING, reason)
        resumed = self.scheduler.reset_workers()
        self._update_gauges()
        return resumed

    def resume(self, workers: WorkerGroup) -> None:
        """Continue on the restarted group ``workers`` (caches allocated, streams open)."""
        self.workers = workers
        self._enter(EngineState.RESUMED)  # until a step succeeds on it

    def fail_all(self, reason: str, error: type[TpserveError] = TpserveError) -> None:
        """Marks the engine dead and fails every request in flight: with INTERNAL (a failed
        step, TpserveError's code) or, for a rank that stopped answering, UnavailableError."""
        self._enter(EngineState.DEAD, reason)  # a loop waiting for a restart that will not come finds it dead
        for state in list(self._states.values()):
            state.queue.put_nowait(error(f"request {state.request_id}: {reason}"))
        self._on_fatal(reason)

    def _update_gauges(self) -> None:
        self.metrics.set_load(len(self.scheduler.running), len(self.scheduler.waiting),
                              self.scheduler.allocator.num_free_blocks)
        # The scheduler counts prefix cache look-ups cumulatively; Prometheus counters only grow by increments.
        queries, hits = self.scheduler.prefix_cache_queries, self.scheduler.prefix_cache_hits
        self.metrics.prefix_cache_queries.inc(queries - self._prefix_cache_counted[0])
        self.metrics.prefix_cache_hits.inc(hits - self._prefix_cache_counted[1])
        self._prefix_cache_counted = (queries, hits)
        if self.scheduler.spec.num_drafts != self._spec_counted.num_drafts:
            self.metrics.add_spec_decode(self.scheduler.spec, self._spec_counted)
            self._spec_counted = self.scheduler.spec.snapshot()

    @property
    def num_requests(self) -> int:
        """Requests in flight (queued or running)."""
        return len(self._states)
