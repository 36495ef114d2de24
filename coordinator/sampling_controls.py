"""Validation of the sampling controls beyond temperature / top-k / top-p (vLLM's ranges).

``min_p``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
``logit_bias``, ``min_tokens``, ``logprobs`` and ``top_logprobs`` of a public ``SamplingParams`` become the keyword
arguments of :class:`tpserve.step.SamplingParams`; every violation raises
:class:`~coordinator.errors.InvalidArgumentError` naming the field and its range.
Protobuf floats can carry NaN and infinities: every range check is written so that
NaN fails it. No torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from coordinator.errors import InvalidArgumentError
from coordinator.grammar_compiler import GrammarCompiler
from coordinator.structured_output import check_stop_conditions, grammar_for
from tpserve.step import MAX_TOP_LOGPROBS
from tpserve.v1 import generate_pb2 as pb

MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's and vLLM's range


def _optional(params: pb.SamplingParams, name: str, default: float) -> float:
    return getattr(params, name) if params.HasField(name) else default


def validate_sampling_controls(params: pb.SamplingParams, vocab_size: int, max_tokens: int,
                               stop_ids: Iterable[int], grammars: GrammarCompiler | None = None) -> dict:
    """The controls of ``params`` as keyword arguments of ``tpserve.step.SamplingParams``.

    Args:
        params: the public sampling parameters.
        vocab_size: token ids in ``logit_bias`` must be in [0, vocab_size).
        max_tokens: the request's max_tokens (min_tokens may not exceed it).
        stop_ids: the tokens ``min_tokens`` holds back: eos (unless ignore_eos) and
            the stop token ids; with a grammar (no stop ids, no ignore_eos) the eos
            ids the ranks allow only where the grammar accepts.
        grammars: compiles ``response_format`` (coordinator/structured_output.py).

    Raises:
        InvalidArgumentError: a value is out of range, NaN or infinite; the message
            names the field and the range.
    """
    min_p = _optional(params, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise InvalidArgumentError(f"sampling_params.min_p must be in [0, 1], got {min_p}")
    repetition_penalty = _optional(params, "repetition_penalty", 1.0)
    if not 0.0 < repetition_penalty < math.inf:
        raise InvalidArgumentError(
            f"sampling_params.repetition_penalty must be a finite number > 0 (1 disables it), got {repetition_penalty}")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = _optional(params, name, 0.0)
        if not -2.0 <= value <= 2.0:
            raise InvalidArgumentError(f"sampling_params.{name} must be in [-2, 2], got {value}")
        penalties[name] = value
    if len(params.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgumentError(
            f"sampling_params.logit_bias has {len(params.logit_bias)} entries; the limit is {MAX_LOGIT_BIAS_ENTRIES}")
    for token_id, bias in params.logit_bias.items():
        if not 0 <= token_id < vocab_size:
            raise InvalidArgumentError(
                f"sampling_params.logit_bias has token id {token_id}; token ids must be in [0, {vocab_size})")
        if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
            raise InvalidArgumentError(f"sampling_params.logit_bias[{token_id}] must be in "
                                       f"[-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], got {bias}")
    min_tokens = params.min_tokens if params.HasField("min_tokens") else 0
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidArgumentError(
            f"sampling_params.min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}")
    top_logprobs = params.top_logprobs if params.HasField("top_logprobs") else 0
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgumentError(f"sampling_params.top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
    if top_logprobs and not params.logprobs:
        raise InvalidArgumentError("sampling_params.top_logprobs needs sampling_params.logprobs set to true")
    check_stop_conditions(params)
    grammar = grammar_for(params.response_format, grammars) if params.HasField("response_format") else ""
    prompt_logprobs = params.prompt_logprobs if params.HasField("prompt_logprobs") else None
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgumentError(
            f"sampling_params.prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {prompt_logprobs}")
    return dict(
        grammar=grammar, prompt_logprobs=prompt_logprobs, logprobs=params.logprobs, top_logprobs=top_logprobs, min_p=min_p, repetition_penalty=repetition_penalty, **penalties,
        logit_bias=tuple(sorted(params.logit_bias.items())), min_tokens=min_tokens,
        min_tokens_stop_ids=tuple(sorted(set(stop_ids))) if min_tokens else (),
        grammar_stop_ids=tuple(sorted(set(stop_ids))) if grammar else (),
    )
