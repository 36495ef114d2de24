"""The public gRPC API: ``Generate``, ``GenerateStream``, ``Abort`` and ``GetModelInfo``.

Protobuf stops here: each handler validates its request into ``GenerateParams``,
iterates the engine's ``RequestOutput`` stream and encodes responses. Errors are
raised as :mod:`coordinator.errors` exceptions and mapped to status codes by the
interceptor. A client that cancels or whose deadline passes ends the handler, which
aborts the request in the engine (its blocks are freed). No torch.
"""

from __future__ import annotations

import time

import grpc

from coordinator.auth import ApiKeyInterceptor, check_priority, is_operator
from coordinator.cache_isolation import tenant_id
from coordinator.chat import prepare_chat
from coordinator.chat_renderer import ChatRenderPool
from coordinator.engine import Engine, RequestOutput
from coordinator.lora_admin import LoRAAdminMethods
from coordinator.lora_registry import LoadedAdapter, LoRARegistry
from coordinator.request_output import aborted_output
from coordinator.request_table import RequestAborted, RequestEntry, check_abort_ids
from coordinator.request_timeline import RequestTimings, replica_name, stamp_timings
from coordinator import tracing
from coordinator.output_collector import UNARY
from coordinator.grammar_compiler import GrammarCompiler
from coordinator.sequence import FinishReason
from coordinator.tokenizer import Tokenizer
from coordinator.errors import InvalidArgumentError, UnavailableError
from coordinator.kv_transfer.stream_moves import StreamMoves
from coordinator.parallel_sampling import generate_n, num_samples
from coordinator.validation import GenerateParams, chat_messages, validate_request
from coordinator.validation_lanes import run_in_lane
from tpserve.v1 import generate_pb2 as pb
from tpserve.v1 import generate_pb2_grpc

_FINISH_REASON_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


class GenerationServicer(LoRAAdminMethods, generate_pb2_grpc.GenerationServicer):
    """Serves the public API of one worker group.

    Args:
        engine: the running engine; None while the model loads (requests get UNAVAILABLE).
        tokenizer: the model's tokenizer.
        model_info: what GetModelInfo answers.
        api_keys: whether callers authenticate with API keys: each key is then a tenant
            of its own in the prefix cache (:mod:`coordinator.cache_isolation`).
        grammars: compiles response_format grammars in child processes under a time
            limit; None compiles them on the validation thread, unbounded (tests).
        keys: the API-key check, which knows each key's role (coordinator/auth.py); None:
            every caller is an operator (one trust domain).
        loras: the LoRA adapters served and their worker slots (a request's ``lora_name``;
            coordinator/lora_admin.py loads and unloads them); None: LoRA is off.
    """

    def __init__(self, engine: Engine | None, tokenizer: Tokenizer, model_info: pb.ModelInfo,
                 api_keys: bool = False, grammars: GrammarCompiler | None = None,
                 keys: ApiKeyInterceptor | None = None, loras: LoRARegistry | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.api_keys = api_keys
        self.keys = keys
        self.grammars = grammars
        self.loras = loras or LoRARegistry(0)
        self.chat_renderer = ChatRenderPool()
        self.replica = replica_name(model_info.model_name)  # in every response's timings
        self.moves: StreamMoves | None = None  # with --kv-transfer-config (launch/public_server.py)

    async def _validate(self, request: pb.GenerateRequest, entry: RequestEntry,
                        lora: LoadedAdapter | None) -> GenerateParams:
        """Validates and tokenizes on a thread of the request's lane (coordinator/validation_lanes.py): a 1 MiB
        prompt takes about a second to tokenize, which on the event loop would freeze every stream and health
        check, and on a shared pool would hold up short requests; a grammar compiles in a child process, the
        thread waiting at most its time limit.
        A chat template renders first, in the bounded renderer pool (never on a thread:
        one that never ends could not be stopped)."""
        chat = None
        if request.WhichOneof("prompt") == "messages":
            prompt = prepare_chat(self.tokenizer, chat_messages(request))
            chat = (prompt, await self.chat_renderer.render(self.tokenizer.chat_template, prompt.messages,
                                                            self.tokenizer.special_tokens_map))
        params = await run_in_lane(request, validate_request, request, self.tokenizer, self.model_info.vocab_size,
                                   self.model_info.max_model_len, entry.tenant, chat, self.grammars,
                                   {lora.name: lora.slot} if lora else None, lora.cache_key if lora else None)
        entry.validated_s = time.monotonic()  # the trace's validate span ends here
        return params

    def is_operator(self, context: grpc.aio.ServicerContext) -> bool:
        """Whether the caller holds the operator role (always, without API keys)."""
        return is_operator(self.keys, context.invocation_metadata())

    async def close(self) -> None:
        """Stops the chat template renderers (at shutdown)."""
        await self.chat_renderer.close()

    def _check_loaded(self) -> Engine:
        if self.engine is None:
            raise UnavailableError("the model is still loading; retry when the health service reports SERVING")
        return self.engine

    def _receive(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                 n: int) -> tuple[Engine, RequestEntry, LoadedAdapter | None]:
        """Registers a request as it arrives, before validation: an Abort of its id from now on
        ends it (coordinator/request_table.py), and its LoRA adapter cannot be unloaded
        (coordinator/lora_registry.py). The handler closes both when it ends (:meth:`_close`)."""
        engine = self._check_loaded()
        check_priority(request.priority, self.is_operator(context))  # before the table: refused whole
        tenant = tenant_id(context.invocation_metadata()) if self.api_keys else ""
        lora = self.loras.acquire(request.lora_name) if request.lora_name else None  # NOT_FOUND: refused whole
        try:
            entry = engine.requests.open(request.request_id, tenant, n)
        except BaseException:
            if lora is not None:
                self.loras.release(lora)
            raise
        if lora is not None:
            entry.lora_slot = lora.slot  # a restart that loses the adapter fails it (launch/recovery.py)
        if tracing.enabled():  # once per request; off: nothing
            entry.trace_context = tracing.extract(context.invocation_metadata())
        return engine, entry, lora

    def _close(self, engine: Engine, entry: RequestEntry, lora: LoadedAdapter | None) -> None:
        """The request's handler ends: its table entry closes and its adapter may be unloaded."""
        engine.requests.close(entry)
        if lora is not None:
            self.loras.release(lora)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        if num_samples(request.sampling_params) > 1:
            raise InvalidArgumentError("sampling_params.n > 1 needs GenerateStream (its messages carry the index)")
        engine, entry, lora = self._receive(request, context, 1)
        text: list[str] = []
        token_ids: list[int] = []
        last: RequestOutput | None = None
        logprobs: list[pb.TokenLogprob] = []
        prompt_logprobs: list[pb.TokenLogprob] = []
        try:
            try:
                params = await entry.unless_aborted(self._validate(request, entry, lora))
            except RequestAborted:  # an Abort while it was validated
                last = stamp_timings(aborted_output(entry.request_id, 0), entry, None)
            else:  # UNARY: the engine wakes this handler once, at the end, with every token merged.
                async for output in engine.generate(params, context.time_remaining(), UNARY, entry):
                    text.append(output.text)
                    token_ids.extend(output.token_ids)
                    logprobs.extend(_logprobs(output))
                    prompt_logprobs.extend(_logprobs(output, prompt=True))
                    last = output
        finally:
            self._close(engine, entry, lora)
        assert last is not None  # the engine always ends with a finished output
        return pb.GenerateResponse(
            request_id=last.request_id, text="".join(text), token_ids=token_ids,
            finish_reason=_FINISH_REASON_TO_PB[last.finish_reason], usage=_usage(last), logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, timings=timings_pb(last.timings, self.replica))

    async def GenerateStream(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Writes each output as a message with ``context.write`` (grpc.aio's reader-writer API):
        a coroutine, not an async generator, so a message passes no generator of ours (nor the
        error interceptor's) on its way out (docs/design/request-path.md, "Where a streamed token's coordinator CPU
        goes")."""
        n = num_samples(request.sampling_params)
        engine, entry, lora = self._receive(request, context, n)
        write = context.write
        try:
            try:
                params = await entry.unless_aborted(self._validate(request, entry, lora))
            except RequestAborted:  # an Abort while it was validated: every sample ends now
                for index in range(n):
                    await write(_stream_response(stamp_timings(aborted_output(entry.request_id, 0), entry, None),
                                                 index, self.replica))
                return
            if n == 1:  # the common case: no task of generate_n's in between
                moves = self.moves  # --kv-transfer-config: a moved stream carries its KV (kv_transfer/stream_moves.py)
                held = None
                if moves is not None:
                    held, params = await moves.pull_moved_in(engine, params, context.invocation_metadata())
                try:
                    if moves is not None:
                        moves.track(entry)
                    async for output in engine.generate(params, context.time_remaining(), None, entry):
                        if output.text or output.token_ids or output.finish_reason is not None or output.prompt_logprobs:
                            await write(_stream_response(output, 0, self.replica))
                finally:
                    if moves is not None and held is not None:
                        moves.untrack(entry)
                        held.release(engine.scheduler)
                return
            async for index, output in generate_n(engine, params, n, context.time_remaining(), None, entry):
                if output.text or output.token_ids or output.finish_reason is not None or output.prompt_logprobs:
                    await write(_stream_response(output, index, self.replica))  # else text held back and no token: nothing to send
        finally:
            self._close(engine, entry, lora)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Ends the named requests wherever they are (coordinator/request_table.py).

        Raises:
            InvalidArgumentError: more than MAX_ABORT_IDS ids.
        """
        check_abort_ids(request.request_ids)
        engine = self._check_loaded()
        # With API keys a caller may end only its own requests; without, requests have no owner.
        tenant = tenant_id(context.invocation_metadata()) if self.api_keys else None
        return pb.AbortResponse(num_aborted=engine.abort_requests(request.request_ids, tenant))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        # While loading, the KV pool and the dtype are not known yet: UNAVAILABLE, as Generate.
        self._check_loaded()
        return self.model_info


def _stream_response(output: RequestOutput, index: int, replica: str) -> pb.GenerateStreamResponse:
    """One stream message; only the fields that are set are filled (a message per token per stream);
    the last carries the timings, with ``replica``."""
    response = pb.GenerateStreamResponse(request_id=output.request_id, index=index, text=output.text,
                                         token_ids=output.token_ids)
    if output.finish_reason is not None:
        response.finish_reason = _FINISH_REASON_TO_PB[output.finish_reason]
        response.usage.CopyFrom(_usage(output))
        response.timings.CopyFrom(timings_pb(output.timings, replica))
    if output.logprobs:
        response.logprobs.extend(_logprobs(output))
    if output.prompt_logprobs:
        response.prompt_logprobs.extend(_logprobs(output, prompt=True))
    return response


def _logprobs(output: RequestOutput, prompt: bool = False) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, text=lp.text, top_logprobs=[
        pb.TopLogprob(token_id=top.token_id, logprob=top.logprob, text=top.text) for top in lp.top_logprobs])
        for lp in (output.prompt_logprobs if prompt else output.logprobs)]


def _usage(output: RequestOutput) -> pb.Usage:
    return pb.Usage(prompt_tokens=output.num_prompt_tokens, completion_tokens=output.num_completion_tokens,
                    cached_prompt_tokens=output.num_cached_prompt_tokens)


def timings_pb(timings: RequestTimings | None, replica: str) -> pb.RequestTimings:
    """``timings`` as the protocol's message (all zero but ``replica`` when None: a sample that
    failed before the engine saw it)."""
    if timings is None:
        return pb.RequestTimings(replica=replica)
    return pb.RequestTimings(
        queue_time_s=timings.queue_time_s, prefill_time_s=timings.prefill_time_s, decode_time_s=timings.decode_time_s,
        time_to_first_token_s=timings.time_to_first_token_s, num_preemptions=timings.num_preemptions,
        cached_prompt_tokens=timings.cached_prompt_tokens, replica=replica)
