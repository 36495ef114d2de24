"""A stream message as the client hands it over (tpserve/results.py ``chunk_of``, still ``_chunk`` in
tpserve.client): the usual one mid-stream and the last one, with every field the message carries."""

from __future__ import annotations

from tpserve.client import StreamChunk, Usage, _chunk
from tpserve.v1 import generate_pb2 as pb


def test_a_mid_stream_message_carries_its_text_tokens_and_sample_index() -> None:
    message = pb.GenerateStreamResponse(request_id="r-1", text=" the", token_ids=[42, 7], index=2)
    assert _chunk(message) == StreamChunk("r-1", " the", [42, 7], None, None, (), (), 2)


def test_the_last_message_carries_its_finish_reason_usage_and_logprobs() -> None:
    message = pb.GenerateStreamResponse(request_id="r-1", text=".", token_ids=[5],
                                        finish_reason=pb.FINISH_REASON_LENGTH)
    message.usage.prompt_tokens, message.usage.completion_tokens, message.usage.cached_prompt_tokens = 9, 4, 8
    message.logprobs.add(token_id=5, logprob=-0.25, text=".")
    chunk = _chunk(message)
    assert (chunk.finish_reason, chunk.usage) == ("length", Usage(9, 4, 8))
    assert [(lp.token_id, lp.logprob) for lp in chunk.logprobs] == [(5, -0.25)]


def test_a_mid_stream_message_with_logprobs_keeps_them() -> None:
    message = pb.GenerateStreamResponse(request_id="r-1", text="a", token_ids=[3])
    message.prompt_logprobs.add(token_id=1, logprob=-1.5)
    chunk = _chunk(message)
    assert chunk.finish_reason is None and chunk.usage is None
    assert [lp.token_id for lp in chunk.prompt_logprobs] == [1]
