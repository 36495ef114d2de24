"""The coordinator's side of the worker protocol: fan each step plan out to every rank.

Every rank receives the same ``StepPlan`` on its own step stream: a Unix socket for a rank of
the coordinator's host (tpserve/step_socket.py), the gRPC ``Step`` stream for one of another
host; both read and fail alike here. The sampling rank
(rank 0, or with pipeline stages rank 0 of the last stage, tpserve/pipeline_split.py)
answers each plan with the step's tokens; the step is done when it has. Every other rank
answers only a step that fails (``ERRORS_ONLY``, tpserve/step_pb.py): a task per such rank
keeps a read open on its stream, so a step costs the coordinator one read however many
ranks there are, and a failed peer is still seen at once. A rank that answers with an
error, closes its stream or misses the step timeout makes the whole group unusable:
:class:`WorkerGroupError` is raised and the caller fails the requests in flight. No torch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import grpc
import structlog

from coordinator.step_socket_stream import SocketStepStream
from tpserve.cluster_secret import client_interceptors
from tpserve.step import StepPlan, StepResult
from tpserve.step_pb import ERRORS_ONLY, STEP_PROTOCOL, plan_to_pb, result_from_pb
from tpserve.step_socket import socket_path
from tpserve.v1 import worker_pb2 as pb
from tpserve.v1 import worker_pb2_grpc

log = structlog.get_logger(__name__)

#: Seconds between liveness checks of every rank, and the most a rank may take to answer
#: one: a rank that is alive but stuck (SIGSTOP, a hung kernel, a host gone without a
#: FIN) is declared lost within LIVENESS_INTERVAL_S + LIVENESS_TIMEOUT_S, whatever the
#: step's length. GetStatus runs on the rank's gRPC pool threads, not the step's thread,
#: so a long step does not delay the answer (docs/design/faults.md, "A liveness check").
LIVENESS_INTERVAL_S = 1.0
LIVENESS_TIMEOUT_S = 3.0

_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 * 1024**2), ("grpc.max_receive_message_length", 64 * 1024**2)]


class _StreamBroke(Exception):
    """Rank ``rank``'s step stream failed (the process died, or its connection did)."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(rank, reason)
        self.rank, self.reason = rank, reason


@dataclass(frozen=True)
class RankLoss:
    """Why :meth:`WorkerGroup.watch_liveness` gave up on the group.

    Attributes:
        reason: one line per lost rank, joined.
        stuck: every lost rank is alive but answers nothing in time (the group is down:
            UNAVAILABLE); False when a rank is gone or reports an error (a worker failure:
            INTERNAL, as when a step finds it first; ARCHITECTURE.md, "Errors").
    """

    reason: str
    stuck: bool


def _being_cancelled() -> bool:
    """Whether the running task was asked to cancel (``Task.cancelling``, Python 3.11+; False before)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling is not None and cancelling())


class WorkerGroupError(RuntimeError):
    """A rank failed, died or timed out; the group cannot run another step."""


class WorkerGroup:
    """Async client of the N ranks of one tensor-parallel group.

    Args:
        addresses: each rank's gRPC address, rank order.
        step_timeout_s: seconds to wait for every rank to answer one step (a multi-step plan of k
            steps: k times as long).
        secret: the group's cluster secret, sent with every call (see tpserve/cluster_secret.py).
        sampling_rank: the rank whose answers carry the tokens and that builds grammars
            (rank 0 of the last pipeline stage; 0 without stages).
    """

    def __init__(self, addresses: Sequence[str], step_timeout_s: float, secret: str | None = None,
                 sampling_rank: int = 0) -> None:
        self.addresses = list(addresses)
        self.sampling_rank = sampling_rank
        # Several steps may be in flight (pipeline micro-batches, coordinator/engine/step_loop.py):
        # plans are written in call order and each step's answers read after the previous step's.
        self._writing = asyncio.Lock()
        self._last_read: asyncio.Future | None = None
        self.step_timeout_s = step_timeout_s
        self._secret = secret
        self._channels = [grpc.aio.insecure_channel(a, options=_CHANNEL_OPTIONS, interceptors=client_interceptors(secret))
                          for a in self.addresses]
        self._stubs = [worker_pb2_grpc.WorkerServiceStub(c) for c in self._channels]
        self._streams: list = []  # per rank: a SocketStepStream (this host) or grpc.aio's Step call
        self._watchers: list[asyncio.Task] = []  # a task per rank that answers only failures
        self._lost: str | None = None  # what such a rank reported: the step in flight fails with it
        self.num_kv_blocks = 0
        self.num_state_slots_available = 0  # hybrids: the state slots every rank can hold (0: none)
        self.num_host_blocks = 0  # the prefix cache's host tier, per rank (coordinator/kv_host_tier.py)
        self.kv_bytes_per_block: dict[int, int] = {}  # rank -> bytes of one KV block there
        self._closed = False  # close() was called: a step it interrupts failed, it was not cancelled
        self.dtype = ""  # as the ranks resolved it
        self.device = ""  # "cpu" or "cuda", as the ranks resolved it
        self.num_threads: dict[int, int] = {}  # rank -> a CPU rank's intra-op threads (0 on CUDA)
        self.failed: str | None = None
        # One PrepareGrammar at a time: rank 0 builds one grammar at a time anyway, and its
        # gRPC pool (4 threads) must keep one free for the liveness checks.
        self._preparing = asyncio.Semaphore(1)

    @property
    def world_size(self) -> int:
        return len(self.addresses)

    async def wait_ready(self, timeout_s: float, poll_s: float = 0.2) -> int:
        """Waits until every rank has loaded its shard; returns the KV blocks all can hold.

        Raises:
            WorkerGroupError: a rank reported a load error, reads another step protocol
                (another tpserve version), or ``timeout_s`` passed.
        """
        deadline = time.monotonic() + timeout_s
        pending = set(range(self.world_size))
        available: dict[int, int] = {}
        slots: dict[int, int] = {}
        while pending:
            for rank in sorted(pending):
                try:
                    status = await self._stubs[rank].GetStatus(pb.GetStatusRequest(), timeout=5.0)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise WorkerGroupError(f"rank {rank}: {exc.code().name}: {exc.details()}") from exc
                    continue  # not listening yet
                if status.error:
                    raise WorkerGroupError(status.error)
                if status.step_protocol != STEP_PROTOCOL:
                    raise WorkerGroupError(
                        f"rank {rank} reads step protocol {status.step_protocol} and this coordinator writes "
                        f"{STEP_PROTOCOL}: the group runs two tpserve versions; run one version on every host")
                if status.ready:
                    available[rank] = status.num_kv_blocks_available
                    slots[rank] = status.num_state_slots_available
                    self.dtype = status.dtype
                    self.device = status.device
                    self.num_threads[rank] = status.num_threads
                    self.kv_bytes_per_block[rank] = status.kv_bytes_per_block
                    pending.discard(rank)
            if pending:
                if time.monotonic() > deadline:
                    raise WorkerGroupError(f"ranks {sorted(pending)} did not load within {timeout_s:.0f} s")
                await asyncio.sleep(poll_s)
        # vLLM's rule: the pool is what the tightest rank can hold (a hybrid's state slots too).
        self.num_state_slots_available = min(slots.values())
        return min(available.values())

    async def start(self, num_kv_blocks: int, num_state_slots: int = 0, num_host_blocks: int = 0) -> None:
        """Allocates every rank's KV cache (a hybrid's ``num_state_slots`` state slots, and ``num_host_blocks``
        host-tier blocks per rank, 0: none; a restart names them again: its ranks, and this object, are new)
        and opens the step streams: a plain socket to each rank of this host (tpserve/step_socket.py), the gRPC
        ``Step`` stream to each rank of another, and to a rank of this host whose step socket does not answer
        (it could not bind one)."""
        request = pb.InitCacheRequest(num_kv_blocks=num_kv_blocks, num_state_slots=num_state_slots,
                                      num_host_blocks=num_host_blocks)
        await asyncio.gather(*(s.InitCache(request) for s in self._stubs))
        self.num_kv_blocks, self.num_host_blocks = num_kv_blocks, num_host_blocks
        streams: list = []
        for rank, (stub, address) in enumerate(zip(self._stubs, self.addresses, strict=True)):
            errors_only = rank != self.sampling_rank
            path = socket_path(address)
            if path is None:
                streams.append(stub.Step(metadata=(ERRORS_ONLY,) if errors_only else None))
                continue
            try:
                streams.append(await SocketStepStream.open(path, errors_only, self._secret))
            except OSError as exc:  # the rank could not bind it (worker/main.py): its gRPC stream serves
                log.warning("no step socket: rank's steps go over its gRPC stream", rank=rank, path=path,
                            error=str(exc))
                streams.append(stub.Step(metadata=(ERRORS_ONLY,) if errors_only else None))
        self._attach(streams)

    def _attach(self, streams: list) -> None:
        """Takes the ranks' open Step streams (rank order) and watches every one but the sampling rank's."""
        self._streams = streams
        self._watchers = [asyncio.ensure_future(self._watch(rank)) for rank in range(len(streams))
                          if rank != self.sampling_rank]

    async def _watch(self, rank: int) -> None:
        """Reads rank ``rank``'s stream, which answers only a failed step: its first error, its end
        or its breaking fails the group, and ends the sampling rank's read of the step in flight.

        That read would otherwise wait for the step timeout: the sampling rank sits in a collective
        waiting for its failed peer until the collective's own timeout (docs/design/faults.md, "The first rank error
        fails the step").
        """
        stream = self._streams[rank]
        try:
            while True:
                result = await stream.read()
                if result is grpc.aio.EOF:
                    reason = f"rank {rank} closed its stream"
                    break
                if result.error:
                    reason = result.error
                    break
                # A success: the rank answers every plan (the stream was opened without ERRORS_ONLY).
        except grpc.aio.AioRpcError as exc:
            reason = f"rank {rank}'s step stream broke ({exc.code().name}: {exc.details()})"
        except OSError as exc:  # the step socket (ConnectionError)
            reason = f"rank {rank}'s step stream broke ({type(exc).__name__}: {exc})"
        except asyncio.CancelledError:
            return  # close(): the group is being shut down or replaced
        self._lost = reason
        self.failed = self.failed or reason
        log.error("worker group failed", reason=reason)
        self._streams[self.sampling_rank].cancel()  # its read in flight raises CancelledError: _fail

    async def execute(self, plan: StepPlan) -> StepResult:
        """Runs one step on every rank and returns the sampling rank's result (:meth:`submit`, then its answer).

        Raises:
            WorkerGroupError: a rank failed, closed its stream, or exceeded the step timeout.
        """
        return await (await self.submit(plan))

    async def submit(self, plan: StepPlan) -> asyncio.Future[StepResult]:
        """Sends one step to every rank; returns once every rank's stream has the plan, with a
        future of the sampling rank's result, so the caller works while the ranks compute (the
        engine's overlap: docs/design/scheduling.md, "The engine loop"). The step timeout covers both halves.

        Several steps may be in flight (pipeline micro-batches, coordinator/engine/step_loop.py):
        plans are written in call order and each step's answers are read after the previous step's.

        Raises:
            WorkerGroupError: the group failed already, or a plan could not be written; the
                future raises it for a rank that fails, closes its stream or times out.
        """
        if self.failed:
            raise WorkerGroupError(self.failed)
        msg = plan_to_pb(plan)
        # The loop's clock (time.monotonic()); a multi-step plan's answer comes after its num_steps steps.
        deadline = asyncio.get_running_loop().time() + self.step_timeout_s * plan.num_steps
        async with self._writing:
            try:
                await asyncio.wait_for(asyncio.gather(*(stream.write(msg) for stream in self._streams)),
                                       self.step_timeout_s)
                if _being_cancelled():
                    # asyncio.wait_for (Python 3.11) returns the writes' result when they end just as the
                    # caller is cancelled, and the cancellation is lost (gh-86296). Delivered here, or the
                    # engine loop would wait on this step at shutdown, and the group's close() under it
                    # would read as a group failure (exit 1).
                    raise asyncio.CancelledError
            except BaseException as exc:  # noqa: BLE001 - mapped to a WorkerGroupError or re-raised
                self._fail(plan, exc)
            previous, mine = self._last_read, asyncio.get_running_loop().create_future()
            self._last_read = mine
        return asyncio.ensure_future(self._answer(plan, deadline, previous, mine))

    async def _answer(self, plan: StepPlan, deadline: float, previous: asyncio.Future | None,
                      mine: asyncio.Future) -> StepResult:
        """The sampling rank's result of a submitted step; a failure any rank reports fails it.

        ``previous`` resolves to whether the step written before this one had its answer read
        (the sampling rank's stream is then at this step's answer); ``mine`` is set the same way
        for the next.
        """
        clean = False
        # The step's deadline cancels this task (asyncio.wait_for would wrap the reads in one more
        # task per step; this runs on every step: docs/design/scheduling.md, "The engine loop").
        task, expired = asyncio.current_task(), []

        def expire() -> None:
            expired.append(True)
            if task is not None:
                task.cancel()

        timer = asyncio.get_running_loop().call_at(deadline, expire)
        try:
            if previous is not None and not await previous:  # the earlier step's answer comes first
                result = pb.StepResult(step_id=plan.step_id, error="an earlier step in flight failed")
            else:
                result = await self._read()
            clean = result is not grpc.aio.EOF and not result.error
        except BaseException as exc:  # noqa: BLE001 - mapped to a WorkerGroupError or re-raised
            self._fail(plan, asyncio.TimeoutError() if expired and isinstance(exc, asyncio.CancelledError) else exc)
        finally:
            timer.cancel()
            if not mine.done():
                mine.set_result(clean)
        if result is grpc.aio.EOF:
            self.failed = f"step {plan.step_id}: rank {self.sampling_rank} closed its stream"
        elif result.error:
            self.failed = self.failed or result.error  # a watched rank's reason, when it came first
        else:
            # Valid even when another rank failed meanwhile: the step's collectives all completed.
            return result_from_pb(result)
        log.error("worker group failed", reason=self.failed)
        raise WorkerGroupError(self.failed)

    def _fail(self, plan: StepPlan, exc: BaseException) -> NoReturn:
        """Marks the group failed for ``exc`` and raises WorkerGroupError; re-raises what is not a
        failure of the group (the caller's task cancelled at shutdown, a bug)."""
        ours = (asyncio.TimeoutError, asyncio.InvalidStateError, _StreamBroke, grpc.aio.AioRpcError,
                grpc.aio.UsageError, ConnectionError)
        if self._lost is not None and (isinstance(exc, ours) or (isinstance(exc, asyncio.CancelledError)
                                                                 and not _being_cancelled())):
            # A rank that answers only failures reported one (_watch) and cancelled the sampling rank's
            # stream under this step (its read, or a plan being written): that report is the cause.
            self.failed = f"step {plan.step_id} failed: {self._lost}"
        elif isinstance(exc, asyncio.TimeoutError):
            self.failed = f"step {plan.step_id} timed out after {self.step_timeout_s * plan.num_steps:g} s"
        elif isinstance(exc, _StreamBroke):
            self.failed = f"step {plan.step_id} failed: rank {exc.rank}'s step stream broke ({exc.reason})"
        elif isinstance(exc, (grpc.aio.AioRpcError, grpc.aio.UsageError, ConnectionError)):
            self.failed = f"step {plan.step_id} failed: a step stream broke: {exc}"
        elif isinstance(exc, asyncio.InvalidStateError):
            # grpc.aio's answer to a write on a call that has ended: a rank died after the last step's
            # answers were read and before this plan was written (the overlap writes it early).
            self.failed = f"step {plan.step_id} failed: a step stream broke: a rank's call had ended ({exc})"
        elif isinstance(exc, asyncio.CancelledError) and self._closed and not _being_cancelled():
            # close() cancelled the streams under this step: the group was declared lost (a node's
            # registry link dropped first) and is being restarted. The engine loop must see a
            # failed step, not die of the cancellation (docs/design/faults.md, "Recovery"). But a caller that was itself
            # cancelled (shutdown cancels the engine loop, then closes the group) is cancelled:
            # a group failure there would fail the shutdown (exit 1).
            self.failed = f"step {plan.step_id} failed: the group's step streams were closed"
        else:
            raise exc  # the caller's task is cancelled (shutdown): not a failure of the group
        log.error("worker group failed", reason=self.failed)
        raise WorkerGroupError(self.failed) from None

    async def _read(self) -> pb.StepResult:
        """The sampling rank's answer to the step just written (or grpc.aio.EOF)."""
        try:
            return await self._streams[self.sampling_rank].read()
        except grpc.aio.AioRpcError as exc:
            raise _StreamBroke(self.sampling_rank, f"{exc.code().name}: {exc.details()}") from exc
        except OSError as exc:  # the step socket (ConnectionError)
            raise _StreamBroke(self.sampling_rank, f"{type(exc).__name__}: {exc}") from exc

    async def prepare_grammar(self, grammar: str) -> None:
        """Has the sampling rank build ``grammar``'s matcher before its request is scheduled.

        Raises:
            WorkerGroupError: the call failed or took over the step timeout (rank 0 down or busy).
            ValueError: rank 0's llguidance refused the grammar.
        """
        async with self._preparing:
            try:
                response = await self._stubs[self.sampling_rank].PrepareGrammar(
                    pb.PrepareGrammarRequest(grammar=grammar), timeout=self.step_timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise WorkerGroupError(f"rank {self.sampling_rank}: PrepareGrammar: {exc.code().name}: "
                                       f"{exc.details()}") from exc
        if response.error:
            raise ValueError(response.error)

    async def load_lora(self, slot: int, path: str) -> None:
        """Has every rank read and check the LoRA adapter at ``path`` into the free ``slot``, beside its steps.

        Shares the grammar builds' one call at a time (each holds a thread of a rank's gRPC pool).

        Raises:
            WorkerGroupError: a call failed or took over the step timeout.
            ValueError: a rank refused the adapter (the first refusal's line: the field or tensor).
        """
        async with self._preparing:
            try:
                responses = await asyncio.gather(*(
                    stub.LoadLoRA(pb.LoadLoRARequest(slot=slot, path=path), timeout=self.step_timeout_s)
                    for stub in self._stubs))
            except grpc.aio.AioRpcError as exc:
                raise WorkerGroupError(f"LoadLoRA: {exc.code().name}: {exc.details()}") from exc
        errors = [r.error for r in responses if r.error]
        if errors:
            raise ValueError(errors[0])

    async def watch_liveness(self, interval_s: float = LIVENESS_INTERVAL_S,
                             timeout_s: float = LIVENESS_TIMEOUT_S) -> RankLoss:
        """Asks every rank for its status every ``interval_s``; returns why, once one fails to answer.

        Returns:
            The loss: ranks that did not answer within ``timeout_s`` seconds (alive but stuck:
            a hung kernel, a host gone without a FIN), and ranks whose channel broke (the
            process is gone: the connection is refused or reset) or that report an error.
        """

        async def check(rank: int) -> tuple[str, bool] | None:
            try:
                status = await self._stubs[rank].GetStatus(pb.GetStatusRequest(), timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return f"rank {rank} did not answer a liveness check within {timeout_s:g} s", True
                return f"rank {rank} failed: its liveness check ended with {exc.code().name}", False
            return (status.error, False) if status.error else None

        while True:
            lost = [found for found in await asyncio.gather(*map(check, range(self.world_size))) if found]
            if lost:
                reason = "; ".join(why for why, _ in lost)
                self.failed = self.failed or reason
                return RankLoss(reason, stuck=all(stuck for _, stuck in lost))
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        """Ends the step streams and closes the channels; a step in flight fails (WorkerGroupError)."""
        self._closed = True
        for watcher in self._watchers:
            watcher.cancel()
        for stream in self._streams:
            stream.cancel()
        await asyncio.gather(*(c.close() for c in self._channels), return_exceptions=True)
