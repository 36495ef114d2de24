"""The engine: continuous batching for one worker group, behind one small facade
(docs/design/scheduling.md, "The engine loop").

Data flow of one step (all on the coordinator's event loop, so no locks):

    Scheduler.schedule() -> StepPlan -> WorkerGroup.submit(plan) -> StepResult
    -> Scheduler.update(plan, result) -> TokenOutput per sampled token
    -> per request: IncrementalDetokenizer -> StopStringMatcher -> RequestOutput
       onto the request's collector, read by its gRPC handler.

The parts, each the only writer of what it owns:

- coordinator/engine/lifecycle.py: the state (SERVING, DRAINING, RECOVERING, RESUMED, DEAD);
- coordinator/engine/requests.py: the requests in flight (admission, abort, failure);
- coordinator/engine/outputs.py: tokens -> outputs, finished-request metrics;
- coordinator/engine/step_loop.py: the steps in flight (plain, async scheduling, pipeline);
- coordinator/engine/gauges.py: the load gauges.

Requests join the running batch at the next step and leave it the step they finish.
A handler that stops listening (client cancel, deadline) aborts its request, which
frees its blocks at once. A worker failure fails every request in flight and marks
the engine dead, unless the group is restarted. No torch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Collection

import structlog

from coordinator.admission import prepare_grammar
from coordinator.engine.gauges import GaugeUpdater
from coordinator.engine.lifecycle import Lifecycle
from coordinator.engine.requests import ActiveRequests
from coordinator.engine.step_loop import StepLoop
from coordinator.engine_state import EngineState
from coordinator.errors import DeadlineExceededError, TpserveError
from coordinator.metrics import Metrics
from coordinator.request_output import RequestOutput, aborted_output
from coordinator.request_table import RequestAborted, RequestEntry
from coordinator.request_timeline import stamp_timings
from coordinator.scheduler import Scheduler
from coordinator.tokenizer import Tokenizer
from coordinator.validation import GenerateParams
from coordinator.worker_client import WorkerGroup

log = structlog.get_logger(__name__)


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

    Attributes:
        lifecycle: the state and why (``dead``, ``recovering``, ``draining``).
        requests: every request from its receipt, by id (Abort's table).
        active: the samples queued or running.
        loop: the step loop (``loop.workers``: the current group).
    """

    def __init__(self, scheduler: Scheduler, workers: WorkerGroup, tokenizer: Tokenizer, max_model_len: int,
                 max_queue_len: int, metrics: Metrics, on_fatal: Callable[[str], None] = lambda _: None,
                 on_group_failure: Callable[[str], bool] = lambda _: False, micro_batches: int = 1,
                 stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        self.scheduler, self.tokenizer, self.metrics = scheduler, tokenizer, metrics
        self.stream_interval, self.micro_batches = stream_interval, micro_batches
        self.max_model_len = max_model_len
        self._on_fatal = on_fatal
        self.lifecycle = Lifecycle()
        self.gauges = GaugeUpdater(scheduler, metrics)
        self.active = ActiveRequests(scheduler, tokenizer, metrics, self.lifecycle, self.gauges, max_model_len,
                                     max_queue_len)
        self.requests = self.active.table
        pipelined = micro_batches > 1
        depth = micro_batches if pipelined else 2 if scheduler.async_scheduling else 1
        self.loop = StepLoop(scheduler, workers, self.lifecycle, self.active, self.gauges, metrics, depth, pipelined,
                             on_group_failure, self.fail_all)

    @property
    def state(self) -> EngineState:
        """The life cycle's state (coordinator/engine_state.py)."""
        return self.lifecycle.state

    @property
    def num_requests(self) -> int:
        """Samples in flight (queued or running)."""
        return len(self.active.states)

    def drain(self) -> None:
        """Refuse new requests; those in flight run to their end. A no-op while the group is
        restarting or down (new requests are refused then anyway; a draining server does not
        restart its group)."""
        if self.lifecycle.state in (EngineState.SERVING, EngineState.RESUMED):
            self.lifecycle.enter(EngineState.DRAINING)

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
            if params.sampling.grammar and self.lifecycle.state in (EngineState.SERVING, EngineState.RESUMED):
                await entry.unless_aborted(prepare_grammar(self.loop.workers, params.sampling.grammar, deadline,
                                                           timeout_s, entry))
            if entry.aborted:
                entry.raise_if_failed()
                raise RequestAborted(entry.request_id)
            state = self.active.add(params, self.stream_interval if stream_interval is None else stream_interval, entry)
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
                self.active.forget(state)
            if own_entry:
                self.requests.close(entry)

    def admit(self, params: GenerateParams, entry: RequestEntry) -> None:
        """Admits all ``entry.num_samples`` samples of a request at once (``n`` > 1): their queue
        places are held until each is queued (:meth:`generate` with ``entry``), so none is
        refused once another has streamed.

        Raises:
            UnavailableError, ResourceExhaustedError: as :meth:`generate`, for the whole request.
        """
        self.active.reserve(params, entry)

    def abort_request(self, request_id: str, tenant: str | None = None) -> int:
        """:meth:`abort_requests` of one id."""
        return self.active.abort((request_id,), tenant)

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
        return self.active.abort(request_ids, tenant)

    async def run(self) -> None:
        """Steps while there is work, sleeps while there is none, until cancelled or the group fails.

        A bug that escapes a step fails every request in flight (INTERNAL) rather than
        leaving them waiting for a loop that no longer runs.
        """
        try:
            await self.loop.run()
        except Exception as exc:  # noqa: BLE001 - no request may hang on a dead loop
            log.exception("engine loop failed")
            self.fail_all(f"engine loop failed: {type(exc).__name__}: {exc}")

    def suspend(self, reason: str) -> int:
        """The worker group is lost and being restarted: hold every request, refuse new ones.

        Running sequences go back to the queue to be recomputed on the new group
        (:meth:`Scheduler.reset_workers`); their clients see a pause, then the rest
        of their streams. Returns the number of sequences that will resume.
        """
        self.lifecycle.enter(EngineState.RECOVERING, reason)
        resumed = self.scheduler.reset_workers()
        self.gauges.update()
        return resumed

    def resume(self, workers: WorkerGroup) -> None:
        """Continue on the restarted group ``workers`` (caches allocated, streams open)."""
        self.loop.workers = workers
        self.lifecycle.enter(EngineState.RESUMED)  # until a step succeeds on it

    def fail_all(self, reason: str, error: type[TpserveError] = TpserveError) -> None:
        """Marks the engine dead and fails every request in flight: with INTERNAL (a failed
        step, TpserveError's code) or, for a rank that stopped answering, UnavailableError."""
        self.lifecycle.enter(EngineState.DEAD, reason)  # a loop waiting for a restart that will not come finds it dead
        self.active.fail(reason, error)
        self._on_fatal(reason)
