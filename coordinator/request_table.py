"""Requests in flight by id, from the moment a handler receives one: the table Abort reads,
and the queue places an ``n`` > 1 request holds for its samples (docs/design/request-path.md, "Abort").

A handler registers its request (:meth:`RequestTable.open`) before anything else happens
to it: validation (tokenizing, the grammar's compile in a child process), rank 0's build
of the grammar, the queue, the fan-out of ``n`` samples. The engine adds each sample it
queues to the request's :class:`RequestEntry`. An Abort finds the entries of an id with
one dict look-up, whatever else is in flight, and marks them aborted: whatever an entry
awaits (:meth:`RequestEntry.unless_aborted`) stops at once, a sample not yet queued never
is (its stream ends with finish_reason ABORT), and the engine ends the samples already
queued. An Abort's id list is bounded (:data:`MAX_ABORT_IDS`), so one call costs the event
loop at most that many look-ups (a 3 MB list once froze every stream for a second).

An ``n`` > 1 request is admitted whole (:meth:`RequestTable.reserve`): its ``n`` queue
places are taken when it arrives, counted as waiting until each sample is queued, so a
sample started after the first one's prefill never finds the queue full.

One event loop, no locks. No torch.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import TypeVar

from coordinator.errors import InvalidArgumentError, ResourceExhaustedError, TpserveError
from coordinator.pushback import queue_full_pushback_ms
from coordinator.sequence import Sequence

#: Most request ids one Abort may name. Above what a gateway's bulk abort of everything one
#: worker holds needs (by default 1,024 waiting + 64 running requests: --max-queue-len,
#: --max-num-seqs), and small enough that matching them (one dict look-up each, about a
#: millisecond for all) never delays a step. More: INVALID_ARGUMENT.
MAX_ABORT_IDS = 4096

T = TypeVar("T")


class RequestAborted(Exception):
    """The request was aborted while it waited for something (:meth:`RequestEntry.unless_aborted`)."""


def check_abort_ids(request_ids: Collection[str]) -> None:
    """Refuses an Abort that names too many ids.

    Raises:
        InvalidArgumentError: more than :data:`MAX_ABORT_IDS` ids.
    """
    if len(request_ids) > MAX_ABORT_IDS:
        raise InvalidArgumentError(f"request_ids has {len(request_ids)} ids; the limit is {MAX_ABORT_IDS} per Abort")


@dataclass(eq=False, slots=True)
class RequestEntry:
    """One received request, all its samples.

    Attributes:
        request_id: the caller's id, or one assigned at receipt when the caller gave none.
        tenant: the caller's tenant ("" without API keys): whose Abort may end it.
        num_samples: its ``n``.
        aborted: an Abort named it: nothing more of it is queued.
        samples: the engine's state of each sample it queued (queued or running, or finished
            while the handler still streams), in the order queued.
        num_reserved: queue places still held for samples not yet queued.
        received_s: when it was received (``time.monotonic()``): where its timings start
            (coordinator/request_timeline.py).
        trace_context: the caller's W3C trace context (``traceparent``) when tracing is on
            (coordinator/tracing.py); None otherwise.
        traced_samples: the ids of the samples whose spans were written (each once).
        validated_s: when its validation ended (tokenization, chat template, the coordinator's
            grammar compilation); None before.
        grammar_s: when rank 0 began and ended building its grammar; None without one.
        lora_slot: its LoRA adapter's worker slot (0: the base model).
        error: why the server ended it (:meth:`fail`; an adapter lost in a restart), None otherwise;
            with ``aborted`` set, so that every wait ends, but its samples end with this error, not ABORT.
    """

    request_id: str
    tenant: str
    num_samples: int = 1
    aborted: bool = False
    lora_slot: int = 0
    error: TpserveError | None = None
    samples: list = field(default_factory=list)
    num_reserved: int = 0
    received_s: float = field(default_factory=time.monotonic)
    trace_context: object = None
    validated_s: float | None = None
    grammar_s: tuple[float, float] | None = None
    traced_samples: set[int] | None = None  # made by the first span written: nothing per request when off
    _abort_waiter: asyncio.Future | None = None  # set when aborted; made only once something waits

    async def unless_aborted(self, awaitable: Awaitable[T]) -> T:
        """``await awaitable``, given up as soon as the request is aborted (the awaitable is
        then cancelled: a thread it waits on runs to its end, its result dropped).

        Raises:
            RequestAborted: the request was aborted before or while it waited.
            TpserveError: :attr:`error`, the server ended it (:meth:`fail`).
        """
        task = asyncio.ensure_future(awaitable)
        # The task may fail in the loop iteration in which this wait is cancelled (gRPC cancels the handler
        # at the client's deadline): nothing would then read its exception, and asyncio would log it with
        # a traceback as never retrieved. The callback reads it; the normal path still raises it below.
        task.add_done_callback(_retrieve_exception)
        if self.aborted:
            task.cancel()
            self.raise_if_failed()
            raise RequestAborted(self.request_id)
        if self._abort_waiter is None:
            self._abort_waiter = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait((task, self._abort_waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()  # aborted, or the handler itself was cancelled
        if not task.done() or task.cancelled():
            self.raise_if_failed()
            raise RequestAborted(self.request_id)
        return task.result()

    def abort(self) -> None:
        """Marks the request aborted and wakes what it waits for."""
        self.aborted = True
        if self._abort_waiter is not None and not self._abort_waiter.done():
            self._abort_waiter.set_result(None)

    def fail(self, error: TpserveError) -> None:
        """Ends the request with ``error`` wherever it waits (validation, its grammar, a sample not yet queued):
        as :meth:`abort`, but each wait raises a copy of ``error``, not RequestAborted."""
        self.error = error
        self.abort()

    def raise_if_failed(self) -> None:
        """Raises a copy of :attr:`error` (one per sample: a raised exception collects its traceback) if set."""
        if self.error is not None:
            raise type(self.error)(str(self.error))


def _retrieve_exception(task: asyncio.Future) -> None:
    """Marks a finished task's exception retrieved (see :meth:`RequestEntry.unless_aborted`)."""
    if not task.cancelled():
        task.exception()


class RequestTable:
    """The requests in flight, by id (every sample of an ``n`` > 1 request under its one id)."""

    def __init__(self) -> None:
        self._by_id: dict[str, list[RequestEntry]] = {}
        #: Queue places held for samples of admitted requests not queued yet (count as waiting).
        self.num_reserved = 0
        #: Called with a traced request as it closes, to record samples that ended without a last
        #: output (set by the engine: coordinator/request_timeline.py's ``trace_unfinished``).
        self.on_unfinished: Callable[[RequestEntry], None] | None = None

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._by_id.values())

    def open(self, request_id: str, tenant: str = "", num_samples: int = 1) -> RequestEntry:
        """Registers a request just received; its handler calls :meth:`close` when it ends.

        Args:
            request_id: the caller's id; "" assigns one (``req-`` and 12 hex digits).
            tenant: the caller's tenant ("" without API keys).
            num_samples: its ``n``.
        """
        entry = RequestEntry(request_id or f"req-{uuid.uuid4().hex[:12]}", tenant, num_samples)
        self._by_id.setdefault(entry.request_id, []).append(entry)
        return entry

    def close(self, entry: RequestEntry) -> None:
        """Forgets a request (its handler ended) and gives back the queue places it still held."""
        self._release(entry)
        if entry.trace_context is not None and self.on_unfinished is not None:  # tracing on: a failed
            self.on_unfinished(entry)  # sample still gets its span (request_timeline.trace_unfinished)
        entries = self._by_id.get(entry.request_id)
        if entries is None:
            return
        try:
            entries.remove(entry)
        except ValueError:
            return
        if not entries:
            del self._by_id[entry.request_id]

    def abort(self, request_ids: Collection[str], tenant: str | None = None) -> list[RequestEntry]:
        """Marks every request named in ``request_ids`` aborted (of ``tenant``; None: anyone's) and
        gives back their queue places. One look-up per id.

        Returns:
            The requests newly aborted (not those an earlier Abort ended).

        Raises:
            InvalidArgumentError: more than :data:`MAX_ABORT_IDS` ids.
        """
        check_abort_ids(request_ids)
        aborted = []
        for request_id in request_ids:
            for entry in self._by_id.get(request_id, ()):
                if not entry.aborted and (tenant is None or entry.tenant == tenant):
                    entry.abort()
                    self._release(entry)
                    aborted.append(entry)
        return aborted

    def fail_lora(self, lora_slot: int, error: TpserveError) -> list[RequestEntry]:
        """Ends every request using the adapter in ``lora_slot`` with ``error`` (:meth:`RequestEntry.fail`) and
        gives back their queue places; returns them. Touches every request in flight: for the rare adapter
        lost in a worker group's restart, never on the hot path."""
        failed = [entry for entries in self._by_id.values() for entry in entries
                  if entry.lora_slot == lora_slot and not entry.aborted]
        for entry in failed:
            entry.fail(error)
            self._release(entry)
        return failed

    def reserve(self, entry: RequestEntry, waiting: Collection[Sequence], max_queue_len: int) -> None:
        """Takes the queue places of all ``entry.num_samples`` samples at once.

        Args:
            waiting: the sequences waiting in the scheduler now.
            max_queue_len: most sequences that may wait.

        Raises:
            ResourceExhaustedError: the samples do not all fit in the queue now.
        """
        self._release(entry)  # (admitted twice: its places once)
        self.check_queue(entry.num_samples, waiting, max_queue_len)
        entry.num_reserved = entry.num_samples
        self.num_reserved += entry.num_samples

    def check_queue(self, num_samples: int, waiting: Collection[Sequence], max_queue_len: int) -> None:
        """Refuses ``num_samples`` more waiting sequences that the queue of ``waiting`` ones cannot take.

        Raises:
            ResourceExhaustedError: the queue is full, or too full for all of them; it carries the
                server pushback of the queue's state (coordinator/pushback.py), none (do not retry) where
                ``num_samples`` exceeds ``max_queue_len``.
        """
        num_waiting = len(waiting)
        if num_waiting + self.num_reserved + num_samples <= max_queue_len:
            return
        if num_samples > max_queue_len:  # no wait cures it: no pushback (the client's retry would fail alike)
            raise ResourceExhaustedError(
                f"the request's n={num_samples} samples can never all wait: the queue holds at most {max_queue_len} "
                "(--max-queue-len); none was started")
        pushback_ms = queue_full_pushback_ms(waiting)
        if num_samples == 1:
            raise ResourceExhaustedError(f"the queue is full ({max_queue_len} requests waiting)", pushback_ms)
        raise ResourceExhaustedError(
            f"the request's n={num_samples} samples do not fit in the queue ({num_waiting + self.num_reserved} of "
            f"{max_queue_len} places taken); none was started", pushback_ms)

    def take_reservation(self, entry: RequestEntry) -> bool:
        """Uses one of ``entry``'s held queue places for a sample being queued; False if it holds none."""
        if entry.num_reserved == 0:
            return False
        entry.num_reserved -= 1
        self.num_reserved -= 1
        return True

    def _release(self, entry: RequestEntry) -> None:
        self.num_reserved -= entry.num_reserved
        entry.num_reserved = 0
