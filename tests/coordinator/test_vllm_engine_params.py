"""The engine protocol's requests and responses translated at the edge (no server, no torch)."""

from __future__ import annotations

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from coordinator.engine import RequestOutput
from coordinator.errors import InvalidArgumentError
from coordinator.logprobs import TokenLogprob, TopLogprob
from coordinator.sequence import FinishReason
from coordinator.vllm_engine_params import chunk, complete, to_generate_request, to_sampling_params


def test_unset_scalars_and_zeros_keep_our_defaults() -> None:
    out = to_sampling_params(vpb.SamplingParams())
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "min_tokens", "seed",
                 "prompt_logprobs"):
        assert not out.HasField(name), name
    assert not out.logprobs and not out.HasField("response_format")


def test_every_supported_field_is_mapped() -> None:
    params = vpb.SamplingParams(temperature=0.5, top_p=0.9, top_k=40, min_p=0.1, frequency_penalty=0.5,
                                presence_penalty=-0.5, repetition_penalty=1.2, max_tokens=7, min_tokens=2,
                                stop=["x"], stop_token_ids=[5], ignore_eos=True, logprobs=3, prompt_logprobs=1,
                                seed=-1, include_stop_str_in_output=True, logit_bias={4: -100.0}, regex="a+")
    out = to_sampling_params(params)
    assert (out.temperature, out.top_p, out.top_k, out.min_p) == pytest.approx((0.5, 0.9, 40, 0.1))
    assert (out.frequency_penalty, out.presence_penalty, out.repetition_penalty) == pytest.approx((0.5, -0.5, 1.2))
    assert (out.max_tokens, out.min_tokens, list(out.stop), list(out.stop_token_ids)) == (7, 2, ["x"], [5])
    assert out.ignore_eos and out.include_stop_str_in_output and dict(out.logit_bias) == {4: -100.0}
    assert (out.logprobs, out.top_logprobs, out.prompt_logprobs) == (True, 3, 1)
    assert out.seed == 2**64 - 1  # an int32 -1 wraps into our uint64 seeds
    assert out.response_format.regex == "a+"
    assert to_sampling_params(vpb.SamplingParams(json_object=True)).response_format.json_schema == '{"type": "object"}'
    assert list(to_sampling_params(vpb.SamplingParams(choice=vpb.ChoiceConstraint(choices=["a", "b"])))
                .response_format.choices.choices) == ["a", "b"]


def test_truncation_keeps_the_last_tokens_and_text_passes_through() -> None:
    request = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3, 4]),
                                  sampling_params=vpb.SamplingParams(truncate_prompt_tokens=2))
    assert list(to_generate_request(request).token_ids.ids) == [3, 4]
    assert to_generate_request(vpb.GenerateRequest(text="hello")).text == "hello"


def test_a_gateways_encoding_of_a_text_gets_the_bos_the_server_adds() -> None:
    """smg sends a completions prompt encoded without special tokens."""
    text_ids = vpb.TokenizedInput(original_text="Once upon", input_ids=[403, 407])
    assert list(to_generate_request(vpb.GenerateRequest(tokenized=text_ids), 1).token_ids.ids) == [1, 403, 407]
    assert list(to_generate_request(vpb.GenerateRequest(tokenized=text_ids)).token_ids.ids) == [403, 407]  # no BOS
    chat_ids = vpb.TokenizedInput(original_text="<s>User: hi", input_ids=[1, 7, 8])  # {{ bos_token }} rendered
    assert list(to_generate_request(vpb.GenerateRequest(tokenized=chat_ids), 1).token_ids.ids) == [1, 7, 8]
    bare_ids = vpb.TokenizedInput(input_ids=[403, 407])  # smg 1.13 sends no original_text
    assert list(to_generate_request(vpb.GenerateRequest(tokenized=bare_ids), 1).token_ids.ids) == [1, 403, 407]
    truncated = vpb.GenerateRequest(tokenized=text_ids, sampling_params=vpb.SamplingParams(truncate_prompt_tokens=2))
    assert list(to_generate_request(truncated, 1).token_ids.ids) == [403, 407]  # encoded, then truncated (vLLM)


@pytest.mark.parametrize(("request_", "field"), [
    (vpb.GenerateRequest(), "input"),
    (vpb.GenerateRequest(tokenized=vpb.TokenizedInput()), "tokenized.input_ids"),
    (vpb.GenerateRequest(text="a", sampling_params=vpb.SamplingParams(truncate_prompt_tokens=2)),
     "truncate_prompt_tokens"),
    (vpb.GenerateRequest(text="a", sampling_params=vpb.SamplingParams(n=17)), "sampling_params.n"),
    (vpb.GenerateRequest(text="a", sampling_params=vpb.SamplingParams(prompt_logprobs=21)),
     "sampling_params.prompt_logprobs"),
    (vpb.GenerateRequest(text="a", media_refs=vpb.MediaRefs()), "media_refs"),
    (vpb.GenerateRequest(text="a", extra_mm_inputs=[vpb.MultimodalInputs()]), "extra_mm_inputs"),
    (vpb.GenerateRequest(text="a", kv_transfer_params=vpb.KvTransferParams()), "kv_transfer_params"),
])
def test_what_we_cannot_do_is_refused_naming_the_field(request_, field) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        to_generate_request(request_)


def test_responses_carry_deltas_usage_and_logprobs() -> None:
    lp = TokenLogprob(9, -0.5, "x", (TopLogprob(9, -0.5, "x"), TopLogprob(8, -1.5, "y")))
    output = RequestOutput("r", "x", [9], FinishReason.STOP, 3, 2, 0, (lp,), (lp, lp))
    streamed = chunk(output, [1, 2, 3], 2, 1, index=1).chunk
    assert (list(streamed.token_ids), streamed.completion_tokens, streamed.prompt_tokens, streamed.index) == \
        ([9], 1, 3, 1)
    assert list(streamed.output_logprobs.top_logprobs[0].token_ids) == [9, 8]
    entries = streamed.input_logprobs
    assert list(entries.token_ids) == [1, 2, 3] and not entries.token_logprobs[0].HasField("value")
    assert [e.value for e in entries.token_logprobs[1:]] == [-0.5, -0.5]
    done = complete(output, [7, 9], [lp, lp], [1, 2, 3], [], 0, 0).complete
    # completion_tokens is the usage: the stopping token (not returned) counts.
    assert (list(done.output_ids), done.finish_reason, done.completion_tokens) == ([7, 9], "stop", 2)
    assert not done.output_logprobs.top_logprobs and not done.HasField("input_logprobs")
