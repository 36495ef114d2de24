"""The engine protocol's requests and responses at the edge: ``vllm.grpc.engine`` <-> ours.

The Shepherd Model Gateway (``smg``) speaks ``vllm.grpc.engine.VllmEngine`` (the
``smg-grpc-proto`` package) to its workers. It tokenizes, renders chat templates and
detokenizes itself, so a request arrives as token ids and a response carries token ids
only. Here a request becomes the public ``tpserve.v1.GenerateRequest`` it means, which
then goes through the same validation as every other request
(:func:`coordinator.validation.validate_request`: the same limits, the same
``sampling_params.*`` field names, which the two protocols share); an engine output
becomes the protocol's chunk and completion messages.

Field meanings follow the vLLM servicer of ``smg-grpc-servicer``: a zero ``top_p``,
``min_p`` or ``repetition_penalty`` is unset (proto3 scalars without presence);
``logprobs = k`` asks for the sampled token's logprob and the k most likely (vLLM's
count, -1 for the whole vocabulary); ``prompt_logprobs`` likewise; the first prompt
token has an entry without a value. What this server cannot do is refused with
INVALID_ARGUMENT naming the field: multimodal inputs, KV transfer (prefill/decode
disaggregation), a data-parallel rank other than 0, a ``structural_tag`` or Lark
``grammar`` constraint, whole-vocabulary logprobs.

No torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from coordinator.request_output import RequestOutput
from coordinator.errors import InvalidArgumentError
from coordinator.logprobs import TokenLogprob
from coordinator.parallel_sampling import MAX_N
from coordinator.sequence import FinishReason
from tpserve.step import MAX_TOP_LOGPROBS, SEED_MODULUS
from tpserve.v1 import generate_pb2 as pb

_INT32_MAX = 2**31 - 1
FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


def to_generate_request(request: vpb.GenerateRequest, bos_token_id: int | None = None,
                        kv_transfer: bool = False, max_model_len: int | None = None) -> pb.GenerateRequest:
    """The public request an engine-protocol request means (not yet validated).

    ``kv_transfer``: this server has a ``--kv-transfer-config``, so ``kv_transfer_params_json`` is
    read (by the caller: coordinator/kv_transfer/params.py) rather than refused.

    ``bos_token_id``: the BOS this server's tokenizer starts a text prompt with (None: it adds none).
    The engine protocol's tokenized input is how a gateway sends text: smg tokenizes every prompt
    itself, and encodes a ``/v1/completions`` prompt without special tokens (its completion
    preparation stage; 1.13 sends no ``original_text``), where ``Generate`` with the same text and
    vLLM's own completions endpoint start it with the BOS. So ids that do not start with the BOS get
    it in front, as our chat path gives a rendered template that lacks it one, before any
    ``truncate_prompt_tokens`` (vLLM truncates after encoding): the same text gives the same tokens
    on both paths. Ids that start with it (a chat template's ``{{ bos_token }}``) are taken as sent.
    ``max_model_len``: a prompt that the BOS makes too long is refused here, naming the BOS (the
    validation's message would count a token the caller never sent); GetModelInfo's
    ``max_req_input_len`` leaves room for it.

    Raises:
        InvalidArgumentError: a field this server does not support is set (the message
            names it), or the BOS put first makes the prompt reach ``max_model_len``.
    """
    for name in ("mm_inputs", "media_refs"):
        if request.HasField(name):
            raise InvalidArgumentError(f"{name} is not supported: this server serves text-only models")
    if request.extra_mm_inputs:
        raise InvalidArgumentError("extra_mm_inputs is not supported: this server serves text-only models")
    if request.HasField("kv_transfer_params"):
        raise InvalidArgumentError("kv_transfer_params (Mooncake's) is not supported: use kv_transfer_params_json "
                                   "(the NIXL connector's fields)")
    if request.HasField("kv_transfer_params_json") and not kv_transfer:
        raise InvalidArgumentError("kv_transfer_params is not supported: this server does no prefill/decode "
                                   "disaggregation (start it with --kv-transfer-config)")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidArgumentError(f"data_parallel_rank is {request.data_parallel_rank}; this server has one "
                                   "data-parallel rank, 0")
    out = pb.GenerateRequest(request_id=request.request_id)
    kind = request.WhichOneof("input")
    params = request.sampling_params
    if kind == "tokenized":
        ids = list(request.tokenized.input_ids)
        if not ids:
            raise InvalidArgumentError("tokenized.input_ids is empty; it must have at least 1 token")
        sent, inserted = len(ids), bos_token_id is not None and ids[0] != bos_token_id
        if inserted:
            ids.insert(0, bos_token_id)
        if params.HasField("truncate_prompt_tokens"):
            ids = _truncate(ids, params.truncate_prompt_tokens)
        if inserted and max_model_len is not None and len(ids) >= max_model_len:
            raise InvalidArgumentError(
                f"tokenized.input_ids has {sent} tokens, and with the BOS this server puts first (as its own "
                f"encoding of text starts) {len(ids)}; a prompt must be shorter than max_model_len={max_model_len} "
                f"(GetModelInfo's max_req_input_len: {max_model_len - 2})")
        if max(ids) > _INT32_MAX:
            raise InvalidArgumentError(f"tokenized.input_ids contains {max(ids)}, outside the vocabulary")
        out.token_ids.ids.extend(ids)
    elif kind == "text":
        if params.HasField("truncate_prompt_tokens"):
            raise InvalidArgumentError("sampling_params.truncate_prompt_tokens needs a tokenized input")
        out.text = request.text
    else:
        raise InvalidArgumentError("input is missing: set tokenized or text")
    out.sampling_params.CopyFrom(to_sampling_params(params))
    return out


def _truncate(ids: list[int], keep: int) -> list[int]:
    """vLLM's left truncation: the last ``keep`` tokens of the prompt."""
    if keep < 1:
        raise InvalidArgumentError(f"sampling_params.truncate_prompt_tokens must be >= 1, got {keep}")
    return ids[-keep:]


def to_sampling_params(params: vpb.SamplingParams) -> pb.SamplingParams:
    """The public sampling parameters of an engine-protocol request.

    Raises:
        InvalidArgumentError: ``n`` > MAX_N, an unsupported constraint, or logprob counts
            out of [0, 20]; the message names the field.
    """
    if params.n > MAX_N:
        raise InvalidArgumentError(f"sampling_params.n must be in [1, {MAX_N}], got {params.n}")
    out = pb.SamplingParams(stop=list(params.stop), ignore_eos=params.ignore_eos,
                            include_stop_str_in_output=params.include_stop_str_in_output)
    if params.HasField("temperature"):
        out.temperature = params.temperature
    if params.HasField("max_tokens"):
        out.max_tokens = min(params.max_tokens, _INT32_MAX)
    # proto3 scalars without presence: 0 is "unset" (the vLLM servicer's reading).
    if params.top_k:
        out.top_k = min(params.top_k, _INT32_MAX)
    for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if value != 0.0:
            setattr(out, name, value)
    if params.min_tokens:
        out.min_tokens = min(params.min_tokens, _INT32_MAX)
    if params.stop_token_ids and max(params.stop_token_ids) > _INT32_MAX:
        raise InvalidArgumentError(f"sampling_params.stop_token_ids contains {max(params.stop_token_ids)}, "
                                   "outside the vocabulary")
    out.stop_token_ids.extend(params.stop_token_ids)
    if params.HasField("seed"):
        out.seed = params.seed % SEED_MODULUS  # int32 here, uint64 ours: a negative seed wraps
    for token_id, bias in params.logit_bias.items():
        out.logit_bias[token_id] = bias
    if params.HasField("logprobs"):
        out.logprobs = True
        out.top_logprobs = _logprob_count("sampling_params.logprobs", params.logprobs)
    if params.HasField("prompt_logprobs"):
        out.prompt_logprobs = _logprob_count("sampling_params.prompt_logprobs", params.prompt_logprobs)
    _set_constraint(params, out.response_format)
    return out


def _logprob_count(field: str, value: int) -> int:
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidArgumentError(f"{field} must be in [0, {MAX_TOP_LOGPROBS}] (-1, the whole vocabulary, is "
                                   f"not supported), got {value}")
    return value


def _set_constraint(params: vpb.SamplingParams, response_format: pb.ResponseFormat) -> None:
    kind = params.WhichOneof("constraint")
    if kind is None:
        return
    if kind == "json_schema":
        response_format.json_schema = params.json_schema
    elif kind == "json_object":
        if params.json_object:
            response_format.json_schema = '{"type": "object"}'
    elif kind == "regex":
        response_format.regex = params.regex
    elif kind == "choice":
        response_format.choices.choices.extend(params.choice.choices)
    else:  # grammar (Lark/EBNF), structural_tag
        raise InvalidArgumentError(f"sampling_params.{kind} is not supported; use json_schema, json_object, "
                                   "regex or choice")


# -- responses -------------------------------------------------------------------------------


def output_logprobs(logprobs: Sequence[TokenLogprob], num_top: int) -> vpb.OutputLogProbs | None:
    """The protocol's logprobs of returned tokens (``num_top`` alternatives each, when > 0)."""
    if not logprobs:
        return None
    out = vpb.OutputLogProbs(token_logprobs=[lp.logprob for lp in logprobs],
                             token_ids=[lp.token_id for lp in logprobs])
    if num_top:
        out.top_logprobs.extend(_top(lp) for lp in logprobs)
    return out


def input_logprobs(prompt_token_ids: Sequence[int], logprobs: Sequence[TokenLogprob],
                   num_top: int) -> vpb.InputLogProbs | None:
    """The protocol's prompt logprobs: one entry per prompt token, the first without a value
    (ours start at the second token)."""
    if not logprobs:
        return None
    out = vpb.InputLogProbs(token_ids=list(prompt_token_ids))
    out.token_logprobs.append(vpb.InputTokenLogProb())
    out.token_logprobs.extend(vpb.InputTokenLogProb(value=lp.logprob) for lp in logprobs)
    if num_top:
        out.top_logprobs.append(vpb.TopLogProbs())
        out.top_logprobs.extend(_top(lp) for lp in logprobs)
    return out


def _top(lp: TokenLogprob) -> vpb.TopLogProbs:
    return vpb.TopLogProbs(values=[top.logprob for top in lp.top_logprobs],
                           token_ids=[top.token_id for top in lp.top_logprobs])


def chunk(output: RequestOutput, prompt_token_ids: Sequence[int], num_logprobs: int,
          num_prompt_logprobs: int, index: int = 0) -> vpb.GenerateResponse:
    """One streamed delta of sample ``index``: the tokens this output added (counts are deltas, as vLLM's)."""
    return vpb.GenerateResponse(chunk=vpb.GenerateStreamChunk(
        index=index,
        token_ids=output.token_ids, prompt_tokens=output.num_prompt_tokens,
        completion_tokens=len(output.token_ids), cached_tokens=output.num_cached_prompt_tokens,
        output_logprobs=output_logprobs(output.logprobs, num_logprobs),
        input_logprobs=input_logprobs(prompt_token_ids, output.prompt_logprobs, num_prompt_logprobs)))


def complete(last: RequestOutput, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob],
             prompt_token_ids: Sequence[int], prompt_logprobs: Sequence[TokenLogprob], num_logprobs: int,
             num_prompt_logprobs: int, index: int = 0) -> vpb.GenerateResponse:
    """The final message of sample ``index``: ``token_ids`` and ``logprobs`` are the whole completion's when not
    streaming, the last delta's when streaming (as vLLM's servicer sends them).

    ``completion_tokens`` is the request's usage, the stopping token (EOS or a stop token
    id, never returned) included, as ``tpserve.v1``'s usage counts it.
    """
    return vpb.GenerateResponse(complete=vpb.GenerateComplete(
        index=index, output_ids=token_ids, finish_reason=FINISH_REASONS[last.finish_reason],
        prompt_tokens=last.num_prompt_tokens, completion_tokens=last.num_completion_tokens,
        cached_tokens=last.num_cached_prompt_tokens,
        output_logprobs=output_logprobs(logprobs, num_logprobs),
        input_logprobs=input_logprobs(prompt_token_ids, prompt_logprobs, num_prompt_logprobs)))
