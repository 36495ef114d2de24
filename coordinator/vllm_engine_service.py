"""The engine protocol a gateway routes: ``vllm.grpc.engine.VllmEngine``, on the public port.

The Shepherd Model Gateway (``smg launch --backend vllm --worker-urls grpc://HOST:PORT``)
registers a worker by asking GetModelInfo, GetServerInfo and GetTokenizer (it builds
its own tokenizer from the archive, so it needs no copy of the model directory), then
sends tokenized Generate calls, polls GetLoads for its load-aware policies and
HealthCheck for liveness, and calls Abort when its HTTP client goes away. Every call
lands on the same engine as ``tpserve.v1.Generation``: the same validation, queue,
prefix cache and metrics (:mod:`coordinator.vllm_engine_params` translates at the
edge). Errors are :mod:`coordinator.errors` exceptions, mapped to status codes by the
one interceptor.

With ``--kv-transfer-config`` a replica is a prefill or decode worker of ``smg --pd-disaggregation``:
a Generate with ``do_remote_decode`` returns its held blocks' kv_transfer_params on its final
message, one with ``do_remote_prefill`` pulls them before it is queued
(:mod:`coordinator.kv_transfer.connector`).

SubscribeKvEvents streams the prefix cache's stored and removed blocks
(:mod:`coordinator.kv_events`), which the gateway's ``cache_aware`` policy routes on. Not
served (UNIMPLEMENTED, with the reason): Embed (generation models only) and the profiler
RPCs. The protocol has no
``cache_salt`` field: requests through a gateway share the anonymous tenant's
unsalted prefix cache unless the server requires API keys (each key a tenant).
FlushCache, SubscribeKvEvents and GetLoads act on or show every tenant: with API keys they
need an operator key (coordinator/auth.py); GetServerInfo leaves its traffic fields unset
for a tenant.

No torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import json
import time
import zipfile
from datetime import datetime, timezone
from pathlib import Path

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from coordinator.cache_isolation import tenant_id
from coordinator import tracing
from coordinator.engine import Engine
from coordinator.errors import InvalidArgumentError, UnavailableError
from coordinator.kv_transfer.connector import HeldBlocks, KVConnector
from coordinator.kv_transfer.hold_budget import HoldReservation
from coordinator.kv_transfer.params import KVTransferParams, parse_params
from coordinator.kv_events import DEFAULT_MAX_SUBSCRIBERS, KvEventLog
from coordinator.logprobs import TokenLogprob
from coordinator.output_collector import UNARY
from coordinator.parallel_sampling import generate_n
from coordinator.scheduler import Scheduler
from coordinator.request_output import aborted_output
from coordinator.request_table import RequestAborted, RequestEntry, check_abort_ids
from coordinator.sequence import FinishReason
from coordinator.server import GenerationServicer
from coordinator.validation import validate_request
from coordinator.validation_lanes import run_in_lane
from coordinator.vllm_engine_params import chunk, complete, to_generate_request

#: What GetTokenizer ships: the files a Hugging Face tokenizer and its chat template load from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json", "tokenizer.model")
TOKENIZER_CHUNK_BYTES = 64 * 1024
SERVER_TYPE = "tpserve-grpc"
#: Seconds between load records on a quiet SubscribeKvEvents stream (smg 1.13 vetoes a worker
#: whose records stop for 15 s).
KV_EVENTS_HEARTBEAT_S = 1.0


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """Serves ``vllm.grpc.engine.VllmEngine`` over the engine of ``generation``.

    Args:
        generation: the public API's servicer: its engine (None while loading), tokenizer,
            model info and API-key setting are shared, never copied.
        model_dir: the served checkpoint directory (model facts, tokenizer files).
        max_kv_event_subscribers: most SubscribeKvEvents streams at once (``--max-kv-event-subscribers``).
        kv_connector: the replica's prefill/decode hand-offs (``--kv-transfer-config``), or None:
            ``kv_transfer_params_json`` is then refused, as without disaggregation.
    """

    def __init__(self, generation: GenerationServicer, model_dir: Path,
                 max_kv_event_subscribers: int = DEFAULT_MAX_SUBSCRIBERS,
                 kv_connector: KVConnector | None = None) -> None:
        self.generation = generation
        self.kv_connector = kv_connector
        self.model_dir = Path(model_dir)
        self.max_kv_event_subscribers = max_kv_event_subscribers
        self.started = time.monotonic()
        self.last_receive_timestamp = 0.0
        self._tokenizer_archive: tuple[bytes, str] | None = None
        try:
            self._config = json.loads((self.model_dir / "config.json").read_text())
        except (OSError, ValueError):
            self._config = {}

    def _engine(self) -> Engine:
        engine = self.generation.engine
        if engine is None:
            raise UnavailableError("the model is still loading; retry when HealthCheck reports healthy")
        return engine

    # -- generation ------------------------------------------------------------------------

    async def Generate(self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext):
        engine = self._engine()
        self.last_receive_timestamp = time.time()
        gen = self.generation
        tenant = tenant_id(context.invocation_metadata()) if gen.api_keys else ""
        tokenizer = gen.tokenizer
        public = to_generate_request(request, tokenizer.bos_token_id if tokenizer.add_bos_token else None,
                                     kv_transfer=self.kv_connector is not None,
                                     max_model_len=gen.model_info.max_model_len)
        n = max(request.sampling_params.n, 1)
        kv = parse_params(request.kv_transfer_params_json) if request.HasField("kv_transfer_params_json") else None
        if kv is not None and kv.do_remote_decode and n > 1:
            raise InvalidArgumentError("kv_transfer_params_json.do_remote_decode needs sampling_params.n 1")
        # Registered before validation: a gateway's Abort lands wherever the request is (request_table.py).
        entry = engine.requests.open(request.request_id, tenant, n)
        if tracing.enabled():  # the gateway propagates the caller's traceparent
            entry.trace_context = tracing.extract(context.invocation_metadata())
        try:
            async for response in self._generate(engine, entry, request, public, context, kv):
                yield response
        finally:
            engine.requests.close(entry)

    async def _generate(self, engine: Engine, entry: RequestEntry, request: vpb.GenerateRequest,
                        public, context: grpc.aio.ServicerContext, kv: KVTransferParams | None = None):
        gen, n = self.generation, entry.num_samples
        try:
            # The same bounded grammar compiler as tpserve.v1 (a hostile schema through the
            # gateway must not stall the server either); a gateway renders chat itself.
            params = await entry.unless_aborted(run_in_lane(  # coordinator/validation_lanes.py
                public, validate_request, public, gen.tokenizer, gen.model_info.vocab_size,
                gen.model_info.max_model_len, entry.tenant, None, gen.grammars))
            entry.validated_s = time.monotonic()  # the trace's validate span ends here
        except RequestAborted:  # an Abort while it was validated: every sample ends now, with no token
            for index in range(n):
                yield complete(aborted_output(entry.request_id, 0), [], [], [], [], 0, 0, index)
            return
        # Not streamed: each sample's handler is woken once, at its end (coordinator/output_collector.py).
        interval = None if request.stream else UNARY
        held, reservation = HeldBlocks(), None
        connector = self.kv_connector
        if connector is not None and kv is not None and kv.do_remote_decode and connector.config.is_producer:
            # Before it is queued: a hand-off past the holds' share of the pool is refused now, not after its
            # prefill (coordinator/kv_transfer/hold_budget.py).
            reservation = connector.reserve(engine.scheduler, entry.tenant, len(params.prompt_token_ids))
        if connector is not None and kv is not None and kv.do_remote_prefill:
            # Before it is queued: the pulled blocks are then a prefix-cache hit (coordinator/kv_transfer/connector.py),
            # in the namespace the pull says (the request's own, or its own alone without a cluster secret).
            held = await connector.pull(engine.scheduler, list(params.prompt_token_ids), params.cache_namespace, kv)
            if held.namespace is not None:
                params = dataclasses.replace(params, cache_namespace=held.namespace)
        try:
            async for response in self._outputs(engine, entry, request, params, n, interval, context, kv,
                                                reservation):
                yield response
        finally:
            held.release(engine.scheduler)
            if reservation is not None:
                reservation.release()  # a no-op once a hold took it over

    async def _outputs(self, engine: Engine, entry: RequestEntry, request: vpb.GenerateRequest, params, n: int,
                       interval, context: grpc.aio.ServicerContext, kv: KVTransferParams | None,
                       reservation: HoldReservation | None = None):
        sampling = request.sampling_params
        num_logprobs = sampling.logprobs if sampling.HasField("logprobs") else 0
        num_prompt_logprobs = sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else 0
        prompt = params.prompt_token_ids
        token_ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        prompt_logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        completes = {}
        async for index, output in generate_n(engine, params, n, context.time_remaining(), interval, entry):
            prompt_logprobs[index].extend(output.prompt_logprobs)
            finished = output.finish_reason is not None
            if request.stream:
                if output.token_ids or output.prompt_logprobs:
                    yield chunk(output, prompt, num_logprobs, num_prompt_logprobs, index)
                if finished:
                    yield await self._handed_over(engine, params, kv, output, reservation, complete(
                        output, output.token_ids, output.logprobs, prompt, prompt_logprobs[index], num_logprobs,
                        num_prompt_logprobs, index))
            else:
                token_ids[index].extend(output.token_ids)
                logprobs[index].extend(output.logprobs)
                if finished:
                    completes[index] = await self._handed_over(engine, params, kv, output, reservation, complete(
                        output, token_ids[index], logprobs[index], prompt, prompt_logprobs[index], num_logprobs,
                        num_prompt_logprobs, index))
        for index in sorted(completes):  # not streamed: every sample at the end, in order (as vLLM's servicer)
            yield completes[index]

    async def _handed_over(self, engine: Engine, params, kv: KVTransferParams | None, output,
                           reservation: HoldReservation | None, response: vpb.GenerateResponse) -> vpb.GenerateResponse:
        """A prefill's (``do_remote_decode``) final message, with the kv_transfer_params of its held blocks."""
        connector = self.kv_connector
        if connector is None or kv is None or not kv.do_remote_decode or not connector.config.is_producer:
            return response
        if output.finish_reason == FinishReason.ABORT:
            return response
        response.complete.kv_transfer_params_json = await connector.hand_over(
            engine.scheduler, list(params.prompt_token_ids), params.cache_namespace, reservation=reservation)
        return response

    async def Abort(self, request: vpb.AbortRequest, context: grpc.aio.ServicerContext) -> vpb.AbortResponse:
        """Ends the named requests wherever they are, validating, queued, running, or samples of
        an ``n`` > 1 request not started yet (coordinator/request_table.py).

        Raises:
            InvalidArgumentError: more than MAX_ABORT_IDS ids.
        """
        check_abort_ids(request.request_ids)
        engine = self.generation.engine
        if engine is not None:  # nothing runs while loading: nothing to abort
            tenant = tenant_id(context.invocation_metadata()) if self.generation.api_keys else None
            engine.abort_requests(request.request_ids, tenant)
        return vpb.AbortResponse()

    async def Embed(self, request: vpb.EmbedRequest, context: grpc.aio.ServicerContext) -> vpb.EmbedResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Embed is not served: tpserve serves generation models")

    async def StartProfile(self, request: common_pb2.StartProfileRequest,
                           context: grpc.aio.ServicerContext) -> common_pb2.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "profiling is not served over the engine protocol; "
                            "profile the ranks with torch.profiler (docs/design/kernels.md)")

    async def StopProfile(self, request: common_pb2.StopProfileRequest,
                          context: grpc.aio.ServicerContext) -> common_pb2.ProfileResponse:
        await self.StartProfile(common_pb2.StartProfileRequest(), context)

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext):
        """Operators only (coordinator/auth.py): the events carry every tenant's token ids.
        Streams the prefix cache's events from now on (``start_sequence_number`` is not
        replayed: blocks cached before the subscription are not announced): a batch as soon as
        a step's events are recorded, so that they leave before that step's outputs are streamed.
        A gateway that hears of a turn's blocks only after its client has sent the next turn
        routes that turn blind; a fixed 20 ms poll left that window open after every step.

        The stream answers at once (its headers; and, to a subscriber that asks with
        ``load_records_before_first_batch``, a load record numbered 0) and sends a ``load_only``
        record every :data:`KV_EVENTS_HEARTBEAT_S` while the cache is quiet: smg 1.13 vetoes a
        worker whose subscription does not answer within 2 s, or whose load records stop for 15 s
        (docs/design/request-path.md, "KV event stream answers at once"). Every batch carries the engine's load
        (``EngineLoad``)."""
        scheduler = self._engine().scheduler
        allocator = scheduler.allocator
        log = allocator.listener
        if log is None:  # kept across a worker-group restart (Scheduler.reset_workers)
            log = KvEventLog(allocator.block_size, self.max_kv_event_subscribers)
            scheduler.kv_cache.attach_listener(log)  # both tiers' events
        subscriber = log.subscribe()  # RESOURCE_EXHAUSTED past --max-kv-event-subscribers
        try:
            await context.send_initial_metadata(())
            sample = 1
            # A subscriber that predates load records before the first batch would take a
            # record numbered 0 for a duplicate: it hears nothing until the first batch.
            last_sent = 0 if request.load_records_before_first_batch else None
            if last_sent is not None:
                yield common_pb2.KvEventBatch(sequence_number=0, timestamp=time.time(),
                                              load=engine_load(self._engine().scheduler, sample, load_only=True))
            while True:
                try:
                    batch = await asyncio.wait_for(log.next_batch(subscriber), KV_EVENTS_HEARTBEAT_S)
                except asyncio.TimeoutError:
                    if last_sent is None:
                        continue
                    batch = common_pb2.KvEventBatch(sequence_number=last_sent, timestamp=time.time())
                    load_only = True
                else:
                    last_sent, load_only = batch.sequence_number, False
                sample += 1
                batch.load.CopyFrom(engine_load(self._engine().scheduler, sample, load_only))
                # While this write waits for a slow reader, the engine goes on: the batches
                # it misses are dropped from the shared ring, and its sequence numbers jump.
                yield batch
        finally:
            log.unsubscribe(subscriber)

    # -- state -----------------------------------------------------------------------------------

    async def HealthCheck(self, request: vpb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> vpb.HealthCheckResponse:
        engine = self.generation.engine
        if engine is None:
            return vpb.HealthCheckResponse(healthy=False, message="the model is still loading")
        problem = engine.lifecycle.dead or engine.lifecycle.recovering or ("draining" if engine.lifecycle.draining else "")
        return vpb.HealthCheckResponse(healthy=not problem, message=problem or "serving")

    async def GetModelInfo(self, request: vpb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> vpb.GetModelInfoResponse:
        """The model's facts. ``model_path`` and ``tokenizer_path`` carry the served model's
        name, never the server's directory (a caller learnt the server's file
        layout from it); a gateway fetches the tokenizer with GetTokenizer."""
        self._engine()
        info, tokenizer, config = self.generation.model_info, self.generation.tokenizer, self._config
        return vpb.GetModelInfoResponse(
            model_path=info.model_name, is_generation=True, max_context_length=info.max_model_len,
            vocab_size=info.vocab_size, supports_vision=False, served_model_name=info.model_name,
            tokenizer_path=info.model_name, model_type=config.get("model_type", ""),
            architectures=config.get("architectures", []), eos_token_ids=list(info.eos_token_ids),
            pad_token_id=_int_or(config.get("pad_token_id"), -1),
            bos_token_id=-1 if tokenizer.bos_token_id is None else tokenizer.bos_token_id,
            # A prompt leaves room for one token, and token ids get the BOS put first where they lack it.
            max_req_input_len=info.max_model_len - 1 - (tokenizer.add_bos_token and tokenizer.bos_token_id is not None))

    async def GetServerInfo(self, request: vpb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> vpb.GetServerInfoResponse:
        """The server's configuration and whether it drains (with ``--kv-transfer-config``, the connector,
        role and engine id, and a pairing protocol that keeps replicas of another transport,
        tensor-parallel degree or 8-bit KV cache type apart); to an operator also its traffic
        (requests in flight, the time of the last request, uptime), which shows other
        tenants' requests and so is left unset (0) for a tenant."""
        engine = self._engine()
        info = self.generation.model_info
        response = vpb.GetServerInfoResponse(
            is_paused=engine.lifecycle.draining, server_type=SERVER_TYPE, data_parallel_size=1,
            kv_cache_dtype=info.kv_cache_dtype or "auto",
            block_size=info.block_size, model_dtype=info.dtype, max_num_seqs=engine.scheduler.max_num_seqs)
        if self.kv_connector is not None:  # what the gateway pairs a prefill and a decode replica on
            kv = self.kv_connector.config
            response.kv_connector, response.kv_role, response.kv_engine_id = kv.kv_connector, kv.kv_role, \
                kv.resolved_engine_id
            response.pairing_protocol = f"tpserve-kv/{kv.transport}/tp{self.kv_connector.tp_size}"
            if self.kv_connector.kv_cache_dtype != "auto":  # an 8-bit cache's blocks pair only with its own kind
                response.pairing_protocol += f"/kv-{self.kv_connector.kv_cache_dtype}"
        if self.generation.is_operator(context):
            response.active_requests = engine.num_requests
            response.last_receive_timestamp = self.last_receive_timestamp
            response.uptime_seconds = time.monotonic() - self.started
        return response

    async def GetLoads(self, request: vpb.GetLoadsRequest, context: grpc.aio.ServicerContext) -> vpb.GetLoadsResponse:
        """The queue, KV usage and prefix-cache hit rate of every tenant: operators only
        (coordinator/auth.py refuses a tenant key with PERMISSION_DENIED)."""
        scheduler = self._engine().scheduler
        allocator = scheduler.allocator
        total_tokens = allocator.num_blocks * allocator.block_size
        used_tokens = (allocator.num_blocks - allocator.num_free_blocks) * allocator.block_size
        queries = scheduler.prefix_cache_queries
        load = vpb.SchedulerLoad(
            dp_rank=0, num_running_reqs=len(scheduler.running), num_waiting_reqs=len(scheduler.waiting),
            num_total_reqs=len(scheduler.running) + len(scheduler.waiting), num_used_tokens=used_tokens,
            max_total_num_tokens=total_tokens, token_usage=used_tokens / total_tokens,
            cache_hit_rate=scheduler.prefix_cache_hits / queries if queries else 0.0,
            max_running_requests=scheduler.max_num_seqs,
            num_waiting_uncached_tokens=_waiting_uncached_tokens(scheduler))
        return vpb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version=_version(),
                                    dp_rank_count=1, loads=[load])

    async def FlushCache(self, request: common_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.FlushCacheResponse:
        """Operators only (coordinator/auth.py): drops every tenant's blocks. Drops the prefix cache's unheld blocks; with ``timeout_s`` > 0, first waits up to that
        long for the requests in flight to finish, so that their blocks are dropped too."""
        engine = self._engine()
        deadline = time.monotonic() + max(request.timeout_s, 0.0)
        while engine.num_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        num_dropped = engine.scheduler.kv_cache.flush()
        busy = engine.num_requests
        message = f"dropped {num_dropped} cached blocks" + (
            f"; {busy} requests in flight keep theirs until they finish" if busy else "")
        return common_pb2.FlushCacheResponse(success=not busy, message=message)

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext):
        if self._tokenizer_archive is None:
            self._tokenizer_archive = await asyncio.to_thread(tokenizer_archive, self.model_dir,
                                                              self.generation.tokenizer.served_json())
        data, digest = self._tokenizer_archive
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            last = start + TOKENIZER_CHUNK_BYTES >= len(data)
            yield common_pb2.GetTokenizerChunk(data=data[start:start + TOKENIZER_CHUNK_BYTES],
                                               sha256=digest if last else "")


def engine_load(scheduler: Scheduler, sample: int, load_only: bool) -> common_pb2.EngineLoad:
    """The load record a KV event batch carries: GetLoads' routing numbers, read now (age 0).

    Args:
        scheduler: the engine's scheduler.
        sample: the record's number on its stream (monotonic).
        load_only: the batch carries no events (a heartbeat, or the record before the first batch).
    """
    allocator = scheduler.allocator
    used_blocks = allocator.num_blocks - allocator.num_free_blocks
    return common_pb2.EngineLoad(
        running_requests=len(scheduler.running), waiting_requests=len(scheduler.waiting),
        waiting_uncached_tokens=_waiting_uncached_tokens(scheduler),
        token_usage=used_blocks / allocator.num_blocks if allocator.num_blocks else 0.0,
        max_running_requests=scheduler.max_num_seqs, age_ms=0, sample=sample, load_only=load_only)


def _waiting_uncached_tokens(scheduler: Scheduler) -> int:
    return sum(seq.num_tokens - seq.num_computed_tokens for seq in scheduler.waiting)


def tokenizer_archive(model_dir: Path, tokenizer_json: str | None = None) -> tuple[bytes, str]:
    """A zip of the model's tokenizer files (:data:`TOKENIZER_FILES` that exist) and its SHA-256 hex digest.

    ``tokenizer_json`` replaces the directory's tokenizer.json when given: the server's tokenizer's
    :meth:`~coordinator.tokenizer.Tokenizer.served_json`, whose post-processor adds the special tokens
    the server's own encoding adds, for a client that reads tokenizer.json alone.

    Raises:
        FileNotFoundError: the directory has no tokenizer.json.
    """
    if not (model_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in TOKENIZER_FILES:
            if name == "tokenizer.json" and tokenizer_json is not None:
                archive.writestr(name, tokenizer_json)
            elif (model_dir / name).is_file():
                archive.write(model_dir / name, name)
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def _int_or(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"tpserve {version('tpserve')}"
    except PackageNotFoundError:
        return "tpserve"
