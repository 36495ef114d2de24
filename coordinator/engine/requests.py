"""The engine's requests in flight: admission, queueing, abort and failure
(docs/design/request-path.md, "Abort").

Builds on coordinator/request_table.py (every request by id from its receipt: Abort's
table) and coordinator/admission.py (what may be queued). A request's sample is queued
as a :class:`Sequence` with its text state (coordinator/engine/outputs.py); it leaves
when its handler stops listening (:meth:`ActiveRequests.forget`), an explicit Abort
names it, or the group fails. No torch.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection

import structlog

from coordinator.admission import check_admissible
from coordinator.detokenizer import IncrementalDetokenizer
from coordinator.engine.gauges import GaugeUpdater
from coordinator.engine.lifecycle import Lifecycle
from coordinator.engine.outputs import OutputProcessor, RequestState
from coordinator.errors import InvalidArgumentError, TpserveError
from coordinator.metrics import Metrics
from coordinator.output_collector import RequestOutputCollector
from coordinator.request_output import RequestOutput
from coordinator.request_table import RequestEntry, RequestTable
from coordinator.request_timeline import trace_unfinished
from coordinator.scheduler import Scheduler, TokenOutput
from coordinator.sequence import FinishReason, Sequence, StopParams
from coordinator.stop_strings import StopStringMatcher
from coordinator.tokenizer import Tokenizer
from coordinator.validation import GenerateParams

log = structlog.get_logger(__name__)


class ActiveRequests:
    """Every sample queued or running, by sequence id, and the table of requests by id.

    Attributes:
        table: every request from its receipt, by id (coordinator/request_table.py).
        states: seq id -> the sample's state, while it is queued or running.
        outputs: turns steps' tokens into the samples' outputs.
        unstreamed: a step's tokens between ``Scheduler.update`` and their processing, which
            waits for the next plan to be sent (an await): an explicit Abort meanwhile streams
            its request's first. Written by the step loop.
    """

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, metrics: Metrics, lifecycle: Lifecycle,
                 gauges: GaugeUpdater, max_model_len: int, max_queue_len: int) -> None:
        self.scheduler, self.tokenizer, self.metrics = scheduler, tokenizer, metrics
        self.lifecycle, self.gauges = lifecycle, gauges
        self.max_model_len, self.max_queue_len = max_model_len, max_queue_len
        self.table = RequestTable()
        self.table.on_unfinished = trace_unfinished
        self.states: dict[int, RequestState] = {}
        self.outputs = OutputProcessor(self.states, scheduler, tokenizer, metrics)
        self.unstreamed: list[TokenOutput] = []
        self._seq_ids = itertools.count()
        scheduler.on_preempt = self.preempted

    def reserve(self, params: GenerateParams, entry: RequestEntry) -> None:
        """Admits all ``entry.num_samples`` samples of a request at once (Engine.admit).

        Raises:
            UnavailableError, ResourceExhaustedError: coordinator/admission.py, coordinator/request_table.py.
        """
        check_admissible(self.lifecycle.state, self.lifecycle.reason, params, self.scheduler, self.max_model_len)
        self.table.reserve(entry, self.scheduler.waiting, self.max_queue_len)

    def add(self, params: GenerateParams, stream_interval: int, entry: RequestEntry) -> RequestState:
        """Queues one sample of ``entry``.

        Raises:
            UnavailableError, ResourceExhaustedError: not admissible, or the queue is full.
            InvalidArgumentError: the text of ``generated_token_ids`` contains a stop string.
        """
        held = self.table.take_reservation(entry)  # admitted with its request's other samples
        check_admissible(self.lifecycle.state, self.lifecycle.reason, params, self.scheduler, self.max_model_len,
                         admitted=held)
        if not held:
            self.table.check_queue(1, self.scheduler.waiting, self.max_queue_len)
        seq = Sequence(
            seq_id=next(self._seq_ids),
            prompt_token_ids=list(params.prompt_token_ids),
            sampling=params.sampling,
            stop=StopParams(params.max_tokens, self.tokenizer.eos_token_ids, params.stop_token_ids, params.ignore_eos),
            max_model_len=self.max_model_len,
            cache_namespace=params.cache_namespace,
            lora_slot=params.lora_slot,
            priority=params.priority,
            # A continued request (another replica's earlier output) starts where a sequence
            # resumed by recompute does: its output kept, nothing computed (scheduler.reset_workers).
            output_token_ids=list(params.generated_token_ids),  # usage counts them as prompt tokens
        )
        state = RequestState(entry.request_id, seq, IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids),
                             StopStringMatcher(params.stop, params.include_stop_str_in_output,
                                               params.sampling.min_tokens), entry.received_s,
                             params.tenant, RequestOutputCollector(stream_interval), lora_name=params.lora_name)
        for num_tokens, token_id in enumerate(params.generated_token_ids, 1):  # replayed: stop strings span the seam
            if state.stop_matcher.push(state.detokenizer.step(token_id), num_tokens)[1]:
                raise InvalidArgumentError(f"request {entry.request_id}: the text of generated_token_ids contains a "
                                           "stop string; that completion had ended")
        self.states[seq.seq_id] = state
        entry.samples.append(state)
        self.scheduler.add(seq)
        self.metrics.prompt_tokens.inc(seq.num_usage_prompt_tokens)
        self.lifecycle.wakeup.set()
        return state

    def preempted(self, seq: Sequence) -> None:
        """Counts and logs a preemption (sizes and ids only: no token of the request reaches the log)."""
        self.metrics.num_preemptions.inc()
        state = self.states.get(seq.seq_id)
        log.info("request preempted", request_id=state.request_id if state else None, seq_id=seq.seq_id,
                 num_tokens=seq.num_tokens, num_preemptions=seq.num_preemptions,
                 num_running=len(self.scheduler.running), num_free_blocks=self.scheduler.allocator.num_free_blocks)

    def forget(self, state: RequestState) -> None:
        """Forgets a sample; frees its blocks if it has not finished (cancel, deadline)."""
        if self.states.pop(state.seq.seq_id, None) is None:
            return
        if not state.seq.is_finished:
            self.scheduler.finish(state.seq, FinishReason.ABORT)
            log.info("request aborted", request_id=state.request_id)  # counted as any finished (observability.md, "Finish reasons")
            self.outputs.observe_finished(state, time.monotonic(), FinishReason.ABORT)
        self.gauges.update()

    def abort(self, request_ids: Collection[str], tenant: str | None) -> int:
        """Engine.abort_requests: ends the named requests now; returns how many samples ended.

        Raises:
            InvalidArgumentError: more than MAX_ABORT_IDS ids (coordinator/request_table.py).
        """
        entries = self.table.abort(request_ids, tenant)
        num_aborted = sum(entry.num_samples - len(entry.samples) for entry in entries)  # end before they start
        states = [state for entry in entries for state in entry.samples if state.seq.seq_id in self.states]
        now = time.monotonic()
        if states and self.unstreamed:  # their last step's tokens come first
            seq_ids = {state.seq.seq_id for state in states}
            self.outputs.process([out for out in self.unstreamed if out.seq.seq_id in seq_ids])
            self.unstreamed = [out for out in self.unstreamed if out.seq.seq_id not in seq_ids]
        for state in states:
            seq = state.seq
            if seq.is_finished:
                continue
            self.scheduler.finish(seq, FinishReason.ABORT)
            self.outputs.observe_finished(state, now, FinishReason.ABORT)
            state.queue.put_nowait(RequestOutput(state.request_id, "", [], FinishReason.ABORT, seq.num_usage_prompt_tokens,
                                                 seq.num_usage_completion_tokens, seq.num_cached_prompt_tokens or 0))
            num_aborted += 1
        if entries:
            log.info("request aborted by the caller", request_ids=[entry.request_id for entry in entries[:8]],
                     num_requests=len(entries), num_aborted=num_aborted)
            self.gauges.update()
        return num_aborted

    def fail_one(self, seq_id: int, reason: str) -> None:
        """Fails one sample with INTERNAL naming ``reason``: its request broke the worker group
        (coordinator/engine/probation.py). Its blocks are freed now, so a restart does not resume it."""
        state = self.states.get(seq_id)
        if state is None or state.seq.is_finished:
            return
        self.scheduler.finish(state.seq, FinishReason.ABORT)
        log.error("request failed: it broke the worker group twice", request_id=state.request_id, seq_id=seq_id)
        state.queue.put_nowait(TpserveError(f"request {state.request_id}: {reason}"))

    def fail(self, reason: str, error: type[TpserveError], lora_slot: int | None = None) -> int:
        """Gives every sample in flight ``error`` naming ``reason`` (its handler raises it and forgets the
        sample, whose blocks are freed); returns how many.

        Args:
            lora_slot: only the requests using the adapter in this worker slot, wherever they are: validating,
                queued, running, or a sample not yet started (a restarted group could not read the adapter again:
                launch/recovery.py); None: every sample in flight (a failed engine, a shutdown's grace ending).
        """
        if lora_slot is not None:
            self.table.fail_lora(lora_slot, error(reason))
        failed = [state for state in self.states.values()
                  if lora_slot is None or (state.seq.lora_slot == lora_slot and not state.seq.is_finished)]
        for state in failed:
            state.queue.put_nowait(error(f"request {state.request_id}: {reason}"))
        return len(failed)
