"""Validation of the sampling controls beyond temperature / top-k / top-p (vLLM's ranges).

The logits processors' and the output fields of a public ``SamplingParams`` (those of
the table in tpserve/sampling_fields.py: ``min_p``, the penalties, ``min_tokens``,
``logprobs``, ...) and ``logit_bias`` become the keyword arguments of
:class:`tpserve.step.SamplingParams`; every violation raises
:class:`~coordinator.errors.InvalidArgumentError` naming the field and its range.
Protobuf floats can carry NaN and infinities: every range check is written so that
NaN fails it. No torch.
"""

from __future__ import annotations

from collections.abc import Iterable

from coordinator.errors import InvalidArgumentError
from coordinator.grammar_compiler import GrammarCompiler
from coordinator.structured_output import check_stop_conditions, grammar_for
from tpserve.sampling_fields import FIELDS, FIELDS_BY_NAME, check
from tpserve.v1 import generate_pb2 as pb

MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's and vLLM's range


def field_value(params: pb.SamplingParams, name: str, bounds: dict[str, float] | None = None):
    """A scalar field of the table (tpserve/sampling_fields.py): its value, or its default when unset.

    Raises:
        InvalidArgumentError: out of the table's range (``sampling_params.<name> must be ...``).
    """
    spec = FIELDS_BY_NAME[name]
    has_presence = params.DESCRIPTOR.fields_by_name[name].has_presence
    value = getattr(params, name) if not has_presence or params.HasField(name) else spec.default
    if value is not None and (spec.low is not None or spec.high is not None or spec.high_name):
        try:
            check(name, value, prefix="sampling_params.", bounds=bounds)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
    return value


def validate_sampling_controls(params: pb.SamplingParams, vocab_size: int, max_tokens: int,
                               stop_ids: Iterable[int], grammars: GrammarCompiler | None = None) -> dict:
    """The controls of ``params`` as keyword arguments of ``tpserve.step.SamplingParams``.

    Every scalar field of the table whose stage is ``processor`` or ``output`` is checked
    against its range and passed on by name; ``logit_bias`` (its size and token ids) and the
    grammar are checked here by hand.

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
    controls = {spec.name: field_value(params, spec.name, {"max_tokens": max_tokens}) for spec in FIELDS
                if spec.stage in ("processor", "output") and spec.type is not dict}
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
    if controls["top_logprobs"] and not controls["logprobs"]:
        raise InvalidArgumentError("sampling_params.top_logprobs needs sampling_params.logprobs set to true")
    check_stop_conditions(params)
    grammar = grammar_for(params.response_format, grammars) if params.HasField("response_format") else ""
    return dict(
        controls, grammar=grammar, logit_bias=tuple(sorted(params.logit_bias.items())),
        min_tokens_stop_ids=tuple(sorted(set(stop_ids))) if controls["min_tokens"] else (),
        grammar_stop_ids=tuple(sorted(set(stop_ids))) if grammar else (),
    )
