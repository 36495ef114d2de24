"""A request's outputs between the engine loop and its handler (coordinator/output_collector.py):
outputs a slow handler has not taken yet are merged into one, with nothing lost or reordered, and
a request's deadline is one timer (the per-token cost: docs/design/request-path.md).

Stand-in worker groups sample known tokens; the text is checked against a full decode by the
model's own tokenizer.
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.engine import Engine, RequestOutput
from coordinator.errors import DeadlineExceededError, TpserveError
from coordinator.logprobs import TokenLogprob
from coordinator.output_collector import UNARY, RequestOutputCollector, merge_outputs
from coordinator.sequence import FinishReason
from coordinator.tokenizer import Tokenizer
from coordinator.validation import validate_request
from tests.coordinator.fakes import FakeRankGroup, make_engine
from tpserve.v1 import generate_pb2 as pb

PROMPT = [1, 5, 6, 8]
NUM_TOKENS = 24


def _output(text: str, token_ids: list[int], finish=None, completion=0, logprobs=(), prompt_logprobs=()):
    return RequestOutput("r", text, token_ids, finish, 4, completion, 2, logprobs, prompt_logprobs)


def test_merged_outputs_join_deltas_and_keep_the_later_finish_and_usage() -> None:
    lp = [TokenLogprob(t, -0.5 * t, f"t{t}") for t in (10, 11, 12)]
    prompt_lp = (TokenLogprob(5, -1.0, "p"),)
    first = _output("Once", [10], completion=1, logprobs=(lp[0],), prompt_logprobs=prompt_lp)
    second = _output(" upon a", [11, 12], FinishReason.STOP, completion=3, logprobs=tuple(lp[1:]))
    merged = merge_outputs([first, second])
    assert merged == RequestOutput("r", "Once upon a", [10, 11, 12], FinishReason.STOP, 4, 3, 2, tuple(lp), prompt_lp)
    assert first.token_ids == [10] and second.token_ids == [11, 12]  # inputs untouched


def test_the_collector_merges_what_is_pending_and_hands_an_error_over_after_the_output() -> None:
    async def scenario() -> None:
        collector = RequestOutputCollector()
        getter = asyncio.create_task(collector.get())
        await asyncio.sleep(0)
        assert not getter.done()  # waits for an output
        collector.put_nowait(_output("a", [1], completion=1))
        assert (await getter).token_ids == [1]
        collector.put_nowait(_output("b", [2], completion=2))
        collector.put_nowait(_output("c", [3], completion=3))
        collector.put_nowait(TpserveError("first failure"))
        collector.put_nowait(TpserveError("second failure"))
        merged = await collector.get()
        assert (merged.text, merged.token_ids, merged.num_completion_tokens) == ("bc", [2, 3], 3)
        with pytest.raises(TpserveError, match="first failure"):
            await collector.get()

    asyncio.run(scenario())


def counting_group(step_s: float = 0.0) -> FakeRankGroup:
    """Samples 30 + (the step's number % 40) for each sampled chunk, with logprobs; each step takes ``step_s``."""
    return FakeRankGroup(sample=lambda k, step: 30 + step % 40, logprobs=True, step_s=step_s)


def _engine(tokenizer: Tokenizer, group: FakeRankGroup) -> Engine:
    return make_engine(group=group, tokenizer=tokenizer)


def _params(tokenizer: Tokenizer, **fields):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling_params=pb.SamplingParams(
        temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=True))
    return validate_request(request, tokenizer, 1024, 128, **fields)


async def _collect(engine: Engine, params, lag_s: float, timeout_s: float | None = None) -> list[RequestOutput]:
    loop = asyncio.create_task(engine.run())
    outputs = []
    try:
        async for output in engine.generate(params, timeout_s):
            outputs.append(output)
            await asyncio.sleep(lag_s)  # a slow reader: the engine runs several steps meanwhile
    finally:
        loop.cancel()
    return outputs


@pytest.mark.parametrize("lag_s", [0.0, 0.01], ids=["keeps-up", "lags"])
def test_a_lagging_handler_gets_fewer_outputs_with_every_token_text_and_logprob(tokenizer, lag_s) -> None:
    engine = _engine(tokenizer, counting_group())
    outputs = asyncio.run(_collect(engine, _params(tokenizer), lag_s))
    token_ids = [t for out in outputs for t in out.token_ids]
    expected = [30 + (step % 40) for step in range(1, NUM_TOKENS + 1)]
    assert token_ids == expected
    assert "".join(out.text for out in outputs) == tokenizer.decode(PROMPT + expected)[len(tokenizer.decode(PROMPT)):]
    assert [lp.token_id for out in outputs for lp in out.logprobs] == expected
    assert outputs[-1].finish_reason is FinishReason.LENGTH and outputs[-1].num_completion_tokens == NUM_TOKENS
    assert all(out.finish_reason is None for out in outputs[:-1])
    if lag_s:
        assert len(outputs) < NUM_TOKENS / 2  # merged: far fewer messages than tokens
    else:
        assert len(outputs) == NUM_TOKENS  # one per step when the handler keeps up
    assert engine.scheduler.allocator.num_free_blocks == 64


def test_a_stream_interval_holds_tokens_back_but_never_the_first_output_nor_the_last() -> None:
    async def scenario() -> None:
        collector = RequestOutputCollector(stream_interval=3)
        collector.put_nowait(_output("a", [1], completion=1))
        assert (await collector.get()).token_ids == [1]  # the first output at once (time to first token)
        getter = asyncio.create_task(collector.get())
        collector.put_nowait(_output("b", [2], completion=2))
        collector.put_nowait(_output("c", [3], completion=3))
        await asyncio.sleep(0)
        assert not getter.done()  # 2 tokens pending < 3
        collector.put_nowait(_output("d", [4], completion=4))
        merged = await getter
        assert (merged.text, merged.token_ids, merged.num_completion_tokens) == ("bcd", [2, 3, 4], 4)
        collector.put_nowait(_output("e", [5], completion=5))
        collector.put_nowait(_output("", [], FinishReason.STOP, completion=5))  # the last: at once
        last = await collector.get()
        assert (last.text, last.token_ids, last.finish_reason) == ("e", [5], FinishReason.STOP)
        collector.put_nowait(_output("f", [6], completion=6))  # held back, then handed over before an error
        collector.put_nowait(TpserveError("failed"))
        assert (await collector.get()).token_ids == [6]
        with pytest.raises(TpserveError, match="failed"):
            await collector.get()

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="stream_interval must be at least 1"):
        RequestOutputCollector(stream_interval=0)


@pytest.mark.parametrize("interval", [1, 5, UNARY], ids=["every-step", "five", "unary"])
def test_the_engine_streams_every_token_in_interval_sized_outputs(tokenizer, interval) -> None:
    engine = _engine(tokenizer, counting_group())

    async def collect() -> list[RequestOutput]:
        loop = asyncio.create_task(engine.run())
        try:
            return [out async for out in engine.generate(_params(tokenizer), stream_interval=interval)]
        finally:
            loop.cancel()

    outputs = asyncio.run(collect())
    expected = [30 + (step % 40) for step in range(1, NUM_TOKENS + 1)]
    assert [t for out in outputs for t in out.token_ids] == expected
    assert "".join(out.text for out in outputs) == tokenizer.decode(PROMPT + expected)[len(tokenizer.decode(PROMPT)):]
    sizes = [len(out.token_ids) for out in outputs]
    if interval == UNARY:
        assert sizes == [1, NUM_TOKENS - 1]  # the first token, then the rest at the end
    else:  # the first at once, then interval-sized, the last with what remains
        assert sizes[0] == 1 and all(size == interval for size in sizes[1:-1]) and 1 <= sizes[-1] <= interval
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert engine.scheduler.allocator.num_free_blocks == 64


def test_the_deadline_ends_the_request_and_frees_its_blocks(tokenizer) -> None:
    engine = _engine(tokenizer, counting_group(step_s=0.02))
    with pytest.raises(DeadlineExceededError, match="deadline of 0.100 s exceeded"):
        asyncio.run(_collect(engine, _params(tokenizer), 0.0, timeout_s=0.1))
    assert engine.scheduler.allocator.num_free_blocks == 64 and engine.num_requests == 0
