"""The sampling controls at the coordinator: validation, the step protocol, stop strings kept.

Validation runs on real requests with the embedded model's tokenizer; every refusal
must name the field and its range, NaN and infinities included.
"""

from __future__ import annotations

import math

import pytest

from coordinator.block_allocator import BlockAllocator
from coordinator.errors import InvalidArgumentError
from coordinator.scheduler import Scheduler
from coordinator.sequence import Sequence, StopParams
from coordinator.stop_strings import StopStringMatcher
from coordinator.tokenizer import Tokenizer
from coordinator.validation import validate_request
from tpserve.step import SamplingParams, StepPlan, StepResult
from tpserve.step_pb import plan_from_pb, plan_to_pb
from tpserve.v1 import generate_pb2 as pb

VOCAB_SIZE, MAX_MODEL_LEN = 1024, 512


def request(**sampling) -> pb.GenerateRequest:
    logit_bias = sampling.pop("logit_bias", {})
    msg = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 5, 6]), sampling_params=pb.SamplingParams(**sampling))
    msg.sampling_params.logit_bias.update(logit_bias)
    return msg


def test_controls_reach_the_worker_parameters(tokenizer: Tokenizer) -> None:
    params = validate_request(
        request(max_tokens=10, min_p=0.25, repetition_penalty=1.5, presence_penalty=-0.5, frequency_penalty=2.0,
                logit_bias={7: -100.0, 3: 2.5}, min_tokens=4, stop_token_ids=[9], include_stop_str_in_output=True),
        tokenizer, VOCAB_SIZE, MAX_MODEL_LEN)
    s = params.sampling
    assert (s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (0.25, 1.5, -0.5, 2.0)
    assert s.logit_bias == ((3, 2.5), (7, -100.0)) and s.min_tokens == 4
    assert s.min_tokens_stop_ids == tuple(sorted({9, *tokenizer.eos_token_ids}))
    assert params.include_stop_str_in_output and s.uses_token_history and s.uses_logits_controls
    ignoring = validate_request(request(min_tokens=2, ignore_eos=True, stop_token_ids=[9]), tokenizer, VOCAB_SIZE,
                                MAX_MODEL_LEN)
    assert ignoring.sampling.min_tokens_stop_ids == (9,)
    default = validate_request(request(), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN).sampling
    assert not default.uses_logits_controls and not default.uses_token_history


@pytest.mark.parametrize(("fields", "message"), [
    (dict(min_p=-0.1), r"sampling_params.min_p must be in \[0, 1\], got -0.1"),
    (dict(min_p=math.nan), r"sampling_params.min_p must be in \[0, 1\], got nan"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=math.inf), r"repetition_penalty must be a finite number > 0 \(1 disables it\), got inf"),
    (dict(repetition_penalty=math.nan), r"repetition_penalty .* got nan"),
    (dict(presence_penalty=2.5), r"sampling_params.presence_penalty must be in \[-2, 2\], got 2.5"),
    (dict(presence_penalty=-math.inf), r"presence_penalty must be in \[-2, 2\], got -inf"),
    (dict(frequency_penalty=math.nan), r"sampling_params.frequency_penalty must be in \[-2, 2\], got nan"),
    (dict(logit_bias={5: 101.0}), r"sampling_params.logit_bias\[5\] must be in \[-100, 100\], got 101"),
    (dict(logit_bias={5: math.nan}), r"logit_bias\[5\] must be in \[-100, 100\], got nan"),
    (dict(logit_bias={1024: 1.0}), r"logit_bias has token id 1024; token ids must be in \[0, 1024\)"),
    (dict(logit_bias={-1: 1.0}), r"logit_bias has token id -1"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), r"logit_bias has 1025 entries; the limit is 1024"),
    (dict(min_tokens=-1), r"sampling_params.min_tokens must be in \[0, max_tokens=509\], got -1"),
    (dict(max_tokens=4, min_tokens=5), r"min_tokens must be in \[0, max_tokens=4\], got 5"),
    (dict(logprobs=True, top_logprobs=21), r"sampling_params.top_logprobs must be in \[0, 20\], got 21"),
    (dict(logprobs=True, top_logprobs=-1), r"top_logprobs must be in \[0, 20\], got -1"),
    (dict(top_logprobs=3), r"top_logprobs needs sampling_params.logprobs set to true"),
])
def test_out_of_range_controls_are_invalid_argument_naming_field_and_range(tokenizer: Tokenizer, fields: dict,
                                                                          message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        validate_request(request(**fields), tokenizer, VOCAB_SIZE, MAX_MODEL_LEN)


def test_step_protocol_carries_every_control() -> None:
    sampling = SamplingParams(temperature=0.5, top_k=3, top_p=0.75, seed=2**64 - 1, min_p=0.125,
                              repetition_penalty=1.25, presence_penalty=-0.5, frequency_penalty=1.5,
                              logit_bias=((2, -100.0), (9, 0.25)), min_tokens=3, min_tokens_stop_ids=(2, 7),
                              grammar='{"grammars": []}', grammar_stop_ids=(2, 9))
    from tpserve.step import NewSequence

    plan = StepPlan(4, (NewSequence(1, sampling, 12, (1, 2, 3, 4)),))
    assert plan_from_pb(plan_to_pb(plan)) == plan  # values exact in float32


def test_a_penalized_sequence_after_a_cached_prefix_sends_its_history() -> None:
    scheduler = Scheduler(BlockAllocator(16, 4), max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    first = Sequence(0, list(range(10, 20)), SamplingParams(temperature=0.0), StopParams(4), 64)
    second = Sequence(1, list(range(10, 20)) + [5], penalized, StopParams(4), 64)
    scheduler.add(first)
    plan = scheduler.schedule()
    assert plan.new_seqs[0].num_prompt_tokens == 10 and plan.new_seqs[0].history_token_ids == ()
    scheduler.update(plan, StepResult(plan.step_id, (7,)))
    scheduler.add(second)
    plan = scheduler.schedule()
    (new,) = plan.new_seqs
    assert new.num_prompt_tokens == 11 and new.history_token_ids == tuple(range(10, 18))  # 2 cached blocks
    assert plan.scheduled[1].start_position == 8


def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    kept, dropped = StopStringMatcher(["END"], include_stop=True), StopStringMatcher(["END"])
    assert kept.push("one E") == ("one ", False)
    assert kept.push("ND two") == ("END", True) and kept.push("more") == ("", True)
    assert dropped.push("one EN") == ("one ", False) and dropped.push("D two") == ("", True)


def test_prompt_logprobs_skip_the_prefix_cache_and_are_kept_once() -> None:
    from tpserve.step import PromptLogprobs

    scheduler = Scheduler(BlockAllocator(16, 4), max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    first = Sequence(0, list(range(10, 20)), SamplingParams(temperature=0.0), StopParams(4), 64)
    scoring = Sequence(1, list(range(10, 20)), SamplingParams(temperature=0.0, prompt_logprobs=1), StopParams(4), 64)
    scheduler.add(first)
    plan = scheduler.schedule()
    scheduler.update(plan, StepResult(plan.step_id, (7,)))
    scheduler.add(scoring)
    plan = scheduler.schedule()
    (new,) = plan.new_seqs
    assert new.prompt_token_ids == tuple(range(10, 20)) and plan.scheduled[1].start_position == 0  # no cache hit
    result = StepResult(plan.step_id, (7, 8), prompt_logprobs=(PromptLogprobs(1, 1, (-1.0,) * 9, ((5,),) * 9,
                                                                              ((-0.5,),) * 9),))
    scheduler.update(plan, result)
    assert sorted(scoring.prompt_logprobs) == list(range(1, 10)) and scoring.prompt_logprobs[3] == (-1.0, (5,), (-0.5,))
    again = PromptLogprobs(1, 1, (-9.0,) * 9, ((6,),) * 9, ((-9.0,),) * 9)  # a recompute: the first values stay
    plan = scheduler.schedule()
    scheduler.update(plan, StepResult(plan.step_id, (7, 8), prompt_logprobs=(again,)))
    assert scoring.prompt_logprobs[3] == (-1.0, (5,), (-0.5,))


def test_a_text_prompt_the_model_cannot_embed_is_refused_not_sent_to_the_ranks(tokenizer: Tokenizer) -> None:
    """A tokenizer larger than the model (here 1,024 tokens for a 512-token model) must not crash a rank."""
    ids = tokenizer.encode("Once upon a time", parse_special_tokens=False)
    assert max(ids) >= 512  # the embedded tokenizer's ids for these words are above 512
    with pytest.raises(InvalidArgumentError, match=f"token id {max(ids)}, outside the model's vocabulary"):
        validate_request(pb.GenerateRequest(text="Once upon a time", sampling_params=pb.SamplingParams(max_tokens=4)),
                         tokenizer, 512, 256)
    ok = validate_request(pb.GenerateRequest(text="Once upon a time", sampling_params=pb.SamplingParams(max_tokens=4)),
                          tokenizer, 1024, 256)
    assert list(ok.prompt_token_ids) == ids



@pytest.mark.parametrize("max_tokens", [400, None])
def test_min_tokens_beyond_the_context_room_names_the_room(tokenizer: Tokenizer, max_tokens: int | None) -> None:
    """A min_tokens that only the context's room refuses says so: a message naming ``max_tokens=<room>``
    would name a value the caller never sent (it sent 400, or none)."""
    fields = dict(min_tokens=300) if max_tokens is None else dict(min_tokens=300, max_tokens=max_tokens)
    msg = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 300), sampling_params=pb.SamplingParams(**fields))
    with pytest.raises(InvalidArgumentError) as err:
        validate_request(msg, tokenizer, VOCAB_SIZE, MAX_MODEL_LEN)
    assert str(err.value) == ("sampling_params.min_tokens=300 exceeds the prompt's room in the context: "
                              "max_model_len=512 less the prompt's 300 tokens leaves 212")
