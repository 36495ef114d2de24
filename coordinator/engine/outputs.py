"""A step's sampled tokens -> one RequestOutput per request, onto its collector; finished-request metrics.

Per token (docs/design/request-path.md, "Where a streamed token's coordinator CPU goes"): one
token mid-sequence without logprobs takes a short path with no loop; a speculative step's several tokens go out in one
RequestOutput, cut at the first stop (token, length or stop string). No torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from coordinator.detokenizer import IncrementalDetokenizer
from coordinator.errors import InvalidArgumentError
from coordinator.logprobs import TokenLogprob, prompt_token_logprobs, token_logprob
from coordinator.metrics import Metrics
from coordinator.output_collector import RequestOutputCollector
from coordinator.request_output import RequestOutput
from coordinator.scheduler import Scheduler, TokenOutput
from coordinator.sequence import FinishReason, Sequence
from coordinator.stop_strings import StopStringMatcher
from coordinator.tokenizer import Tokenizer
from tpserve.step import GRAMMAR_DEAD_END_TOKEN_ID


@dataclass(slots=True, eq=False)
class RequestState:
    """One sample in flight: its sequence, text state and collector.

    Attributes:
        arrival_time: ``time.monotonic()`` seconds when its request was received (before validation,
            tokenization and grammar compilation: where the response's timings start too).
        first_token_time: ``time.monotonic()`` seconds of its first output; None before.
        last_token_time: ``time.monotonic()`` seconds of its latest output (the inter-token latency's start).
    """

    request_id: str
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    arrival_time: float
    tenant: str = ""
    queue: RequestOutputCollector = field(default_factory=RequestOutputCollector)
    first_token_time: float | None = None
    last_token_time: float = 0.0
    lora_name: str = ""  # its LoRA adapter, "" for the base model (the metrics' label)


class OutputProcessor:
    """Turns steps' tokens into outputs for the requests in ``states`` (seq id -> state)."""


    def __init__(self, states: dict[int, RequestState], scheduler: Scheduler, tokenizer: Tokenizer,
                 metrics: Metrics) -> None:
        self.states, self.scheduler, self.tokenizer, self.metrics = states, scheduler, tokenizer, metrics

    def process(self, outputs: list[TokenOutput]) -> None:
        """One step's tokens -> one RequestOutput per request (a sequence's tokens are adjacent)."""
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
        state = self.states.get(seq.seq_id)
        if state is None:
            return
        if outs[-1].token_id == GRAMMAR_DEAD_END_TOKEN_ID:  # only a grammar's step, one token: nothing to return
            self.observe_finished(state, now, FinishReason.ABORT)
            state.queue.put_nowait(InvalidArgumentError(
                f"request {state.request_id}: response_format allows no token after {seq.num_output_tokens} generated "
                f"token{'' if seq.num_output_tokens == 1 else 's'}: this model's vocabulary cannot continue the text it accepts there, or the format is too "
                "complex to follow (llguidance's parser limits)"))
            return
        prompt_logprobs: tuple[TokenLogprob, ...] = ()
        if state.first_token_time is None:
            state.first_token_time = now
            self.metrics.time_to_first_token.observe(now - state.arrival_time)
            if seq.sampling.prompt_logprobs is not None:
                prompt_logprobs = prompt_token_logprobs(self.tokenizer, seq.prompt_token_ids, seq.prompt_logprobs)
        else:
            self.metrics.inter_token_latency.observe(now - state.last_token_time)
        state.last_token_time = now
        if len(outs) == 1 and outs[0].finish_reason is None and outs[0].logprobs is None:
            # The common case, one token mid-sequence without logprobs (request-path.md, per-token
            # cost): what the loop below does for it, without the loop.
            token_id = outs[0].token_id
            text, matched = state.stop_matcher.push(state.detokenizer.step(token_id), seq.num_output_tokens)
            finish = None
            if matched:
                self.scheduler.finish(seq, FinishReason.STOP)
                finish = FinishReason.STOP
                self.observe_finished(state, now, finish)
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
                delta, matched = state.stop_matcher.push(state.detokenizer.step(out.token_id),
                                                         seq.num_output_tokens - (len(outs) - 1 - index))
                text += delta
                if matched:
                    self.scheduler.finish(seq, FinishReason.STOP)
                    # Tokens after the stop string's (a multi-token step) were never returned: usage omits them.
                    seq.truncate_output(seq.num_output_tokens - (len(outs) - 1 - index))
                    self.scheduler.spec.take_back(seq.speculation, seq.num_output_tokens)  # nor accepted
                    finish = FinishReason.STOP
            if finish is not None and not matched:
                tail, matched = state.stop_matcher.push(state.detokenizer.flush(), seq.num_output_tokens)
                text += tail if matched else tail + state.stop_matcher.flush()
                if matched:
                    finish = FinishReason.STOP
            if finish is not None:
                break
        if finish is not None:
            self.observe_finished(state, now, finish)
        state.queue.put_nowait(RequestOutput(state.request_id, text, token_ids, finish,
                                             seq.num_usage_prompt_tokens, seq.num_usage_completion_tokens,
                                             seq.num_cached_prompt_tokens or 0, tuple(logprobs), prompt_logprobs))

    def observe_finished(self, state: RequestState, now: float, reason: FinishReason) -> None:
        """Counts a finished request: its reason, tokens, end-to-end latency and time per output token."""
        seq = state.seq
        self.metrics.request_success.labels(finished_reason=reason.value).inc()
        self.metrics.generation_tokens.inc(num_generated := seq.num_usage_completion_tokens)  # not a continuation's
        if state.lora_name:
            self.metrics.add_lora_request(state.lora_name, num_generated)
        self.metrics.e2e_request_latency.observe(now - state.arrival_time)
        if num_generated > 1 and state.first_token_time is not None:
            self.metrics.request_time_per_output_token.observe((now - state.first_token_time) / (num_generated - 1))
