"""Every field of the sampling table (tpserve/sampling_fields.py) reaches every place derived from it.

Table-driven, so a new field is covered by adding it to the table: the coordinator refuses each
field's out-of-range values (NaN and infinities for floats) as INVALID_ARGUMENT naming the field and
its range, the step dataclass refuses them too, an in-range value travels from the public request
through validation and the step protocol to the worker's ``SamplingParams`` unchanged, the client
takes it as a typed keyword, ``tpserve generate`` has its flag, and each logits-processor field is
read by exactly one processor in the worker's declared order.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest

from coordinator.errors import InvalidArgumentError
from coordinator.parallel_sampling import num_samples
from coordinator.validation import validate_request
from tpserve.cli import build_parser
from tpserve.client import Client, build_request
from tpserve.sampling_fields import FIELDS, FIELDS_BY_NAME, SamplingField
from tpserve.step import NewSequence, SamplingParams, StepPlan
from tpserve.step_pb import plan_from_pb, plan_to_pb
from tpserve.v1 import generate_pb2 as pb
from worker.logits_processors import ORDER

VOCAB_SIZE, MAX_MODEL_LEN, MAX_TOKENS = 1024, 512, 50
RANGED = [f for f in FIELDS if f.type not in (list, dict, bool) and (f.low is not None or f.high is not None
                                                                      or f.high_name)]


def _out_of_range(spec: SamplingField) -> list[float]:
    """Values just outside the field's range (and NaN, infinities for a float)."""
    step = 1 if spec.type is int else 0.25
    bad = []
    if spec.low is not None:
        bad.append(spec.low if spec.low_open else spec.low - step)
    if spec.high is not None:
        bad.append(spec.high if spec.high_open else spec.high + step)
    if spec.high_name:
        bad.append(MAX_TOKENS + 1)
    if spec.type is float:
        bad += [math.nan, math.inf, -math.inf]
    return bad


def _in_range(spec: SamplingField) -> float | int | bool:
    """A value in range that is not the default (float32-exact, so it survives the wire)."""
    if spec.type is bool:
        return True
    if spec.name == "min_tokens":
        return 3
    if spec.low is not None and spec.high is not None:
        value = (spec.low + spec.high) / 2
        return int(value) if spec.type is int else 0.375 * spec.high + 0.625 * spec.low
    return spec.low + (3 if spec.type is int else 0.5)


def _public(spec: SamplingField, value) -> pb.SamplingParams | None:
    """A public SamplingParams with the field set, or None when protobuf cannot hold the value."""
    try:
        return pb.SamplingParams(**{spec.name: value}, max_tokens=MAX_TOKENS) if spec.name != "max_tokens" else \
            pb.SamplingParams(max_tokens=value)
    except (ValueError, TypeError):  # an unsigned field cannot carry a negative value: nothing to check
        return None


@pytest.mark.parametrize("spec", RANGED, ids=lambda f: f.name)
def test_out_of_range_values_are_invalid_argument_naming_the_field(spec: SamplingField, tokenizer) -> None:
    for value in _out_of_range(spec):
        params = _public(spec, value)
        if params is None:
            continue
        with pytest.raises(InvalidArgumentError, match=rf"^sampling_params\.{spec.name} must be .*got {value}"):
            if spec.name == "n":
                num_samples(params)  # the server's check of n, before it validates the request
            else:
                validate_request(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 5, 6]), sampling_params=params),
                                 tokenizer, VOCAB_SIZE, MAX_MODEL_LEN)
        if spec.on_worker and not spec.high_name:
            with pytest.raises(ValueError, match=rf"^{spec.name} must be"):
                SamplingParams(**{spec.name: value})


@pytest.mark.parametrize("spec", [f for f in FIELDS if f.on_worker and f.type is not dict], ids=lambda f: f.name)
def test_a_value_reaches_the_worker_unchanged(spec: SamplingField, tokenizer) -> None:
    value = _in_range(spec)
    extra = {"logprobs": True} if spec.name == "top_logprobs" else {}
    params = pb.SamplingParams(**{spec.name: value}, **extra, max_tokens=MAX_TOKENS, stop_token_ids=[9])
    sampling = validate_request(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 5, 6]), sampling_params=params),
                                tokenizer, VOCAB_SIZE, MAX_MODEL_LEN).sampling
    assert getattr(sampling, spec.name) == value != spec.default
    plan = StepPlan(1, (NewSequence(3, sampling, 3),))
    assert plan_from_pb(plan_to_pb(plan)) == plan
    if spec.stage == "processor":  # a control: no speculation, a processor reads it
        assert sampling.uses_logits_controls and not sampling.allows_speculation


def test_unset_fields_take_the_table_defaults(tokenizer) -> None:
    sampling = validate_request(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 5, 6])), tokenizer, VOCAB_SIZE,
                                MAX_MODEL_LEN).sampling
    for spec in FIELDS:
        if spec.on_worker and spec.default is not None:
            assert getattr(sampling, spec.name) == spec.default, spec.name
    assert not sampling.uses_logits_controls and sampling.allows_speculation


def test_the_client_takes_every_field_as_a_typed_keyword() -> None:
    for method in (build_request, Client.generate, Client.generate_stream):
        parameters = inspect.signature(method).parameters
        for spec in FIELDS:
            assert parameters[spec.name].kind is inspect.Parameter.KEYWORD_ONLY
            assert parameters[spec.name].annotation is not inspect.Parameter.empty
            assert spec.name in (method.__doc__ or ""), (method.__name__, spec.name)
    for spec in FIELDS:
        if spec.type in (list, dict):
            continue
        value = _in_range(spec)
        assert getattr(build_request("Hi", **{spec.name: value}).sampling_params, spec.name) == value
    with pytest.raises(TypeError, match="typo_p"):
        build_request("Hi", typo_p=0.5)



def test_a_string_for_a_list_of_strings_is_one_entry_not_its_characters() -> None:
    """``stop="girl named"`` (OpenAI's ``stop`` takes a string or a list) is one stop string: extending the
    repeated field with the string itself would send each character as a stop string, silently."""
    string_lists = [spec.name for spec in FIELDS if spec.type is list and spec.items is str]
    assert "stop" in string_lists
    for name in string_lists:
        assert list(getattr(build_request("Hi", **{name: "girl named"}).sampling_params, name)) == ["girl named"]
        assert list(getattr(build_request("Hi", **{name: ["a", "bc"]}).sampling_params, name)) == ["a", "bc"]
    assert list(build_request("Hi", choices="yes").sampling_params.response_format.choices.choices) == ["yes"]
    assert list(build_request("Hi", choices=("yes", "no")).sampling_params.response_format.choices.choices) == \
        ["yes", "no"]

def test_tpserve_generate_has_a_flag_per_field() -> None:
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    flags = {flag: action for action in generate._actions for flag in action.option_strings}
    for spec in FIELDS:
        if spec.cli:
            assert flags[spec.flag].dest == spec.name and spec.help in flags[spec.flag].help
    args = generate.parse_args([FIELDS_BY_NAME["top_p"].flag, "0.5", "Hi"])
    assert args.top_p == 0.5 and args.temperature is None  # unset: the server's default


def test_each_processor_field_has_one_processor_in_the_declared_order() -> None:
    readers = [name for processor in ORDER for name in processor.fields]
    assert len(readers) == len(set(readers))
    table = {f.name for f in FIELDS if f.stage == "processor"}
    assert table <= set(readers), f"no processor reads {sorted(table - set(readers))}"
    step_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(readers) <= step_fields


def test_none_leaves_every_field_unset_lists_included() -> None:
    """``build_request``'s docstring: None leaves a field unset, for the list fields as for the others
    (``stop=["x"] if c else None`` raised ``TypeError: must assign iterable`` before)."""
    from tpserve.client import build_request

    request = build_request("Hi", stop=None, stop_token_ids=None, logit_bias=None, seed=None, choices=None)
    assert list(request.sampling_params.stop) == [] and list(request.sampling_params.stop_token_ids) == []
    assert not request.sampling_params.HasField("seed")
    assert list(build_request("Hi", stop=["x"]).sampling_params.stop) == ["x"]
