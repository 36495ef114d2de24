"""The engine protocol (``vllm.grpc.engine.VllmEngine``) on a real server of stories260k, by a raw gRPC client.

The last tests check Abort, ``n`` and ``priority`` on the native API (tpserve.v1).
One server with ``--max-num-seqs 1`` serves every test: the queue test needs requests
to wait, the others run one request at a time anyway. Values are checked against the
same server's native API (``tpserve.v1``), itself checked against transformers by the
goldens tests.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import time
import zipfile
from collections.abc import Iterator

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from tests.e2e.cluster import RunningCluster, serve
from tests.paths import STORIES_DIR, requires_stories

pytestmark = [pytest.mark.e2e, requires_stories]

PROMPT = "Once upon a time, there was a little"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningCluster]:
    with serve(STORIES_DIR, 1, "--max-num-seqs", "1") as running:
        yield running


@pytest.fixture(scope="module")
def engine(server: RunningCluster) -> Iterator[vllm_engine_pb2_grpc.VllmEngineStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)


def _request(token_ids: list[int], stream: bool = False, request_id: str = "r", **sampling) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(request_id=request_id, tokenized=vpb.TokenizedInput(input_ids=token_ids),
                               sampling_params=vpb.SamplingParams(**sampling), stream=stream)


def _prompt_ids(server: RunningCluster) -> list[int]:
    from coordinator.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(STORIES_DIR).encode(PROMPT)


def _loads(engine) -> vpb.SchedulerLoad:
    (load,) = engine.GetLoads(vpb.GetLoadsRequest(), timeout=5).loads
    return load


def test_generate_equals_native_generate_streamed_and_not(server: RunningCluster, engine) -> None:
    prompt = _prompt_ids(server)
    native = server.client.generate(prompt, max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=2)
    (whole,) = engine.Generate(_request(prompt, temperature=0.0, max_tokens=24, logprobs=2), timeout=30)
    done = whole.complete
    assert list(done.output_ids) == native.token_ids
    assert done.finish_reason == native.finish_reason == "length"
    assert (done.prompt_tokens, done.completion_tokens) == (len(prompt), 24)
    assert list(done.output_logprobs.token_ids) == native.token_ids
    assert list(done.output_logprobs.token_logprobs) == pytest.approx([lp.logprob for lp in native.logprobs], abs=1e-5)
    assert [list(top.token_ids) for top in done.output_logprobs.top_logprobs] == \
        [[top.token_id for top in lp.top_logprobs] for lp in native.logprobs]

    messages = list(engine.Generate(_request(prompt, stream=True, temperature=0.0, max_tokens=24), timeout=30))
    chunks = [m.chunk for m in messages if m.HasField("chunk")]
    assert [m.WhichOneof("response") for m in messages[-1:]] == ["complete"]
    assert [t for c in chunks for t in c.token_ids] == native.token_ids
    assert len(chunks) > 1  # streamed, not one message at the end
    assert messages[-1].complete.finish_reason == "length"


def test_prompt_logprobs_have_an_empty_first_entry(server: RunningCluster, engine) -> None:
    prompt = _prompt_ids(server)
    native = server.client.generate(prompt, max_tokens=1, temperature=0.0, prompt_logprobs=1)
    (whole,) = engine.Generate(_request(prompt, temperature=0.0, max_tokens=1, prompt_logprobs=1), timeout=30)
    entries = whole.complete.input_logprobs
    assert list(entries.token_ids) == prompt
    assert not entries.token_logprobs[0].HasField("value")
    assert [e.value for e in entries.token_logprobs[1:]] == \
        pytest.approx([lp.logprob for lp in native.prompt_logprobs], abs=1e-5)


@pytest.mark.parametrize(("fields", "named"), [
    (dict(sampling_params=vpb.SamplingParams(n=17)), "sampling_params.n"),
    (dict(sampling_params=vpb.SamplingParams(structural_tag="{}")), "sampling_params.structural_tag"),
    (dict(sampling_params=vpb.SamplingParams(grammar="start: 'a'")), "sampling_params.grammar"),
    (dict(sampling_params=vpb.SamplingParams(logprobs=-1)), "sampling_params.logprobs"),
    (dict(sampling_params=vpb.SamplingParams(max_tokens=0)), "sampling_params.max_tokens"),
    (dict(sampling_params=vpb.SamplingParams(top_p=1.5)), "sampling_params.top_p"),
    (dict(mm_inputs=vpb.MultimodalInputs()), "mm_inputs"),
    (dict(kv_transfer_params_json="{}"), "kv_transfer_params"),
    (dict(data_parallel_rank=1), "data_parallel_rank"),
])
def test_unsupported_or_bad_fields_are_invalid_argument(server: RunningCluster, engine, fields, named) -> None:
    request = vpb.GenerateRequest(request_id="bad", tokenized=vpb.TokenizedInput(input_ids=[1, 400]), **fields)
    with pytest.raises(grpc.RpcError) as info:
        list(engine.Generate(request, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in info.value.details()


def test_abort_ends_the_stream_and_frees_its_blocks_at_once(server: RunningCluster, engine) -> None:
    stream = engine.Generate(_request(_prompt_ids(server), stream=True, request_id="to-abort", temperature=0.0,
                                      max_tokens=400, ignore_eos=True), timeout=60)
    first = next(stream)
    assert first.HasField("chunk")
    assert _loads(engine).num_used_tokens > 0
    engine.Abort(vpb.AbortRequest(request_ids=["to-abort"]), timeout=5)
    rest = list(stream)
    assert rest[-1].complete.finish_reason == "abort"
    load = _loads(engine)
    assert (load.num_used_tokens, load.num_running_reqs, load.num_waiting_reqs) == (0, 0, 0)


def test_get_loads_shows_the_queue(server: RunningCluster, engine) -> None:
    """--max-num-seqs 1 and 8 requests in flight: 1 running, 7 waiting."""
    prompt = _prompt_ids(server)
    streams = [engine.Generate(_request(prompt, stream=True, request_id=f"q{i}", temperature=0.0, max_tokens=400,
                                        ignore_eos=True), timeout=120) for i in range(8)]
    try:  # a server-streaming call starts when it is made, before it is read
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            load = _loads(engine)
            if load.num_running_reqs + load.num_waiting_reqs == 8:
                break
            time.sleep(0.05)
        assert (load.num_running_reqs, load.num_waiting_reqs, load.max_running_requests) == (1, 7, 1)
        assert load.num_waiting_uncached_tokens == 7 * len(prompt)
        assert load.token_usage > 0
    finally:
        engine.Abort(vpb.AbortRequest(request_ids=[f"q{i}" for i in range(8)]), timeout=5)
        for s in streams:
            s.cancel()
    time.sleep(0.2)
    assert _loads(engine).num_used_tokens == 0


def test_model_info_server_info_health_and_tokenizer(server: RunningCluster, engine) -> None:
    info = engine.GetModelInfo(vpb.GetModelInfoRequest(), timeout=5)
    native = server.client.model_info()
    assert (info.max_context_length, info.vocab_size, info.served_model_name) == \
        (native.max_model_len, native.vocab_size, native.model_name)
    assert list(info.eos_token_ids) == list(native.eos_token_ids) and info.is_generation
    assert (info.model_type, list(info.architectures), info.bos_token_id) == ("llama", ["LlamaForCausalLM"], 1)
    server_info = engine.GetServerInfo(vpb.GetServerInfoRequest(), timeout=5)
    assert (server_info.max_num_seqs, server_info.block_size) == (1, native.block_size)
    assert engine.HealthCheck(vpb.HealthCheckRequest(), timeout=5).healthy

    chunks = list(engine.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=10))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert archive.read("tokenizer.json") == (STORIES_DIR / "tokenizer.json").read_bytes()
        assert "tokenizer_config.json" in archive.namelist()


def test_flush_cache_drops_the_prefix_cache(server: RunningCluster, engine) -> None:
    prompt = _prompt_ids(server) * 4  # 3 full blocks of 16
    engine.FlushCache(common_pb2.FlushCacheRequest(), timeout=5)
    (first,) = engine.Generate(_request(prompt, temperature=0.0, max_tokens=2), timeout=30)
    (again,) = engine.Generate(_request(prompt, temperature=0.0, max_tokens=2), timeout=30)
    assert (first.complete.cached_tokens, again.complete.cached_tokens) == (0, 32)
    flushed = engine.FlushCache(common_pb2.FlushCacheRequest(), timeout=5)
    assert flushed.success, flushed.message
    (after,) = engine.Generate(_request(prompt, temperature=0.0, max_tokens=2), timeout=30)
    assert after.complete.cached_tokens == 0


def test_kv_events_announce_stored_and_removed_blocks(server: RunningCluster, engine) -> None:
    # a prompt no other test uses, 2 full blocks; it starts with the BOS (1), as the replica would put it there
    prompt = [1, *((7 * i) % 400 + 3 for i in range(39))]
    engine.FlushCache(common_pb2.FlushCacheRequest(), timeout=5)
    events = engine.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=30)
    time.sleep(0.2)  # subscribed
    (done,) = engine.Generate(_request(prompt, temperature=0.0, max_tokens=2), timeout=30)
    assert done.complete.finish_reason == "length"
    stored = []
    for batch in events:
        stored += [e.stored for e in batch.events if e.HasField("stored")]
        if len(stored) >= 2:
            break
    assert [list(s.blocks[0].token_ids) for s in stored[:2]] == [prompt[:16], prompt[16:32]]
    assert not stored[0].HasField("parent_block_hash")
    assert stored[1].parent_block_hash == stored[0].blocks[0].block_hash
    engine.FlushCache(common_pb2.FlushCacheRequest(), timeout=5)  # the request is done: both blocks go
    removed = set()
    for batch in events:
        removed |= {h for e in batch.events if e.HasField("removed") for h in e.removed.block_hashes}
        if {s.blocks[0].block_hash for s in stored[:2]} <= removed:
            break
    events.cancel()


def test_kv_events_of_a_request_leave_with_its_step_not_a_poll_later(server: RunningCluster, engine) -> None:
    """A gateway routes a session's next turn by the blocks its previous turn stored; its client sends
    that turn as soon as the answer arrives. So the stored event must not trail the answer: a fixed
    20 ms poll made it trail by 0-20 ms (median about 10). Median over 9 requests, each 2 new blocks."""
    import threading

    arrivals: list[tuple[float, common_pb2.KvEventBatch]] = []
    events = engine.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)

    def listen() -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled at the end
            for batch in events:
                arrivals.append((time.monotonic(), batch))

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    time.sleep(0.2)  # subscribed
    lags = []
    for i in range(9):
        prompt = [1, *((11 * j + 101 * i) % 400 + 3 for j in range(35))]  # 2 full blocks no other request has
        (done,) = engine.Generate(_request(prompt, temperature=0.0, max_tokens=1), timeout=30)
        answered = time.monotonic()
        assert done.complete.finish_reason == "length"
        deadline = answered + 5
        while (heard := next((t for t, batch in list(arrivals) for e in batch.events if e.HasField("stored")
                              and list(e.stored.blocks[0].token_ids) == prompt[16:32]), None)) is None:
            assert time.monotonic() < deadline, f"request {i}: its second block was never announced"
            time.sleep(0.001)
        lags.append(heard - answered)
    events.cancel()
    listener.join(5)
    assert sorted(lags)[len(lags) // 2] < 0.004, [f"{lag * 1000:.1f} ms" for lag in lags]


def test_embed_and_profiling_are_unimplemented_with_a_reason(server: RunningCluster, engine) -> None:
    for call in (lambda: engine.Embed(vpb.EmbedRequest(), timeout=5),
                 lambda: engine.StartProfile(common_pb2.StartProfileRequest(), timeout=5)):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and info.value.details()


def test_n_samples_compute_the_prompt_once_and_equal_seeded_native_requests(server: RunningCluster, engine) -> None:
    """n=4: samples 1 to 3 find the prompt's full blocks that sample 0 computed (prefix-cache
    hits 3x the prompt's full blocks); sample i is the native request with seed + i."""
    prompt = (_prompt_ids(server) * 4)[:40]  # 2 full blocks of 16 and 8 tokens
    engine.FlushCache(common_pb2.FlushCacheRequest(), timeout=5)
    hits = server.metric("tpserve:prefix_cache_hits_total")
    messages = list(engine.Generate(_request(prompt, stream=True, temperature=1.0, seed=7, max_tokens=12, n=4),
                                    timeout=60))
    assert server.metric("tpserve:prefix_cache_hits_total") - hits == 3 * 32
    completes = {m.complete.index: m.complete for m in messages if m.HasField("complete")}
    assert sorted(completes) == [0, 1, 2, 3]
    assert sorted(c.cached_tokens for c in completes.values()) == [0, 32, 32, 32]
    for index in range(4):
        tokens = [t for m in messages if m.HasField("chunk") and m.chunk.index == index for t in m.chunk.token_ids]
        native = server.client.generate(prompt, temperature=1.0, seed=7 + index, max_tokens=12)
        assert tokens == native.token_ids
    (whole,) = [list(engine.Generate(_request(prompt, temperature=1.0, seed=7, max_tokens=12, n=2), timeout=60))]
    assert [m.complete.index for m in whole] == [0, 1]
    assert list(whole[1].complete.output_ids) == server.client.generate(prompt, temperature=1.0, seed=8,
                                                                          max_tokens=12).token_ids


# -- the same controls on the native API (tpserve.v1) ---------------------------------------------


def test_native_abort_ends_only_the_named_request_and_frees_its_blocks(server: RunningCluster, engine) -> None:
    stream = server.client.generate_stream(_prompt_ids(server), request_id="native-abort", temperature=0.0,
                                           max_tokens=400, ignore_eos=True, timeout_s=60)
    next(stream)
    assert server.client.abort("no-such-request") == 0
    assert server.client.abort("native-abort") == 1
    assert list(stream)[-1].finish_reason == "abort"
    assert _loads(engine).num_used_tokens == 0


def test_native_n_streams_indexed_samples_from_one_prefill(server: RunningCluster) -> None:
    prompt = (_prompt_ids(server) * 4)[:40]
    with grpc.insecure_channel(server.target) as channel:
        vllm_engine_pb2_grpc.VllmEngineStub(channel).FlushCache(common_pb2.FlushCacheRequest(), timeout=5)
    hits = server.metric("tpserve:prefix_cache_hits_total")
    messages = list(server.client.generate_stream(prompt, temperature=1.0, seed=3, max_tokens=10, n=4, timeout_s=60))
    assert server.metric("tpserve:prefix_cache_hits_total") - hits == 3 * 32
    for index in range(4):
        mine = [m for m in messages if m.index == index]
        native = server.client.generate(prompt, temperature=1.0, seed=3 + index, max_tokens=10)
        assert [t for m in mine for t in m.token_ids] == native.token_ids
        assert "".join(m.text for m in mine) == native.text
        assert mine[-1].finish_reason == "length" and mine[-1].usage.completion_tokens == 10
    with pytest.raises(grpc.RpcError) as info:
        server.client.generate(prompt, n=2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "GenerateStream" in info.value.details()


def test_a_high_priority_request_overtakes_a_queue_of_low_priority_ones(server: RunningCluster, engine) -> None:
    """--max-num-seqs 1: one request runs, 20 of priority 1 wait, then one of priority 0 arrives:
    it is the next admitted, and finishes before any of the 20 starts."""
    import threading

    prompt = _prompt_ids(server)
    first_token_at: dict[str, float] = {}

    def consume(name: str, **kwargs) -> None:
        for message in server.client.generate_stream(prompt, request_id=name, temperature=0.0, timeout_s=120,
                                                     **kwargs):
            if message.token_ids and name not in first_token_at:
                first_token_at[name] = time.monotonic()

    def wait_for_waiting(count: int) -> None:
        # The queue as the server sees it (GetLoads), not a sleep: on an idle machine the
        # blocker's ~500 tokens take well under a second on this model.
        deadline = time.monotonic() + 20
        while _loads(engine).num_waiting_reqs < count:
            assert time.monotonic() < deadline, f"never {count} waiting"
            time.sleep(0.005)

    longest = server.client.model_info().max_model_len - len(prompt) - 1
    blocker = threading.Thread(target=consume, args=("blocker",), kwargs=dict(max_tokens=longest, ignore_eos=True))
    blocker.start()
    while "blocker" not in first_token_at:
        time.sleep(0.01)
    lows = [threading.Thread(target=consume, args=(f"low{i}",), kwargs=dict(max_tokens=4, priority=1))
            for i in range(20)]
    for thread in lows:
        thread.start()
    wait_for_waiting(20)
    high = threading.Thread(target=consume, args=("high",), kwargs=dict(max_tokens=4, priority=0))
    high.start()
    wait_for_waiting(21)
    assert "blocker" in first_token_at and not any(name.startswith("low") for name in first_token_at)
    server.client.abort("blocker")
    for thread in [blocker, high, *lows]:
        thread.join(60)
    assert len(first_token_at) == 22
    assert first_token_at["high"] < min(first_token_at[f"low{i}"] for i in range(20))


def test_kv_events_answer_at_once_and_keep_a_quiet_stream_alive(server: RunningCluster, engine) -> None:
    """Issue 47, item 1: SubscribeKvEvents sent nothing (not even its headers) until the first
    cache event, and smg 1.13 vetoes a worker whose subscription does not answer within 2 s, or
    whose load records stop for 15 s. Now: headers at once; to a subscriber that asks for load
    records before the first batch, a record numbered 0 at once, then one a second while quiet."""
    from coordinator.vllm_engine_service import KV_EVENTS_HEARTBEAT_S

    legacy = engine.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=30)
    start = time.monotonic()
    legacy.initial_metadata()  # blocks until the server sends its headers
    assert time.monotonic() - start < 1.0
    legacy.cancel()
    stream = engine.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(load_records_before_first_batch=True),
                                      timeout=30)
    start = time.monotonic()
    first = next(stream)
    assert time.monotonic() - start < 1.0
    assert first.sequence_number == 0 and not first.events and first.load.load_only
    assert first.load.max_running_requests == 1 and first.load.running_requests == 0
    beat = next(stream)  # nothing is cached meanwhile: a heartbeat
    assert time.monotonic() - start < 3 * KV_EVENTS_HEARTBEAT_S
    assert beat.sequence_number == 0 and beat.load.load_only and beat.load.sample > first.load.sample
    prompt = [1, *((13 * i) % 400 + 5 for i in range(19))]  # one full block no other test stores
    engine.Generate(_request(prompt, temperature=0.0, max_tokens=1), timeout=30).next()
    batch = next(b for b in stream if b.events)
    assert batch.sequence_number == 1 and not batch.load.load_only and batch.load.sample > beat.load.sample
    after = next(stream)  # quiet again: the heartbeat repeats the last sequence sent
    assert after.load.load_only and after.sequence_number == batch.sequence_number
    stream.cancel()


def test_tokenized_input_gets_the_bos_a_text_prompt_gets(server: RunningCluster, engine) -> None:
    """smg encodes a completions prompt without the BOS (docs/design/request-path.md, "One tokenization for both
    paths"): the replica puts it back, so the
    engine protocol and Generate give the same tokens for the same text."""
    ids = _prompt_ids(server)
    assert ids[0] == 1
    native = server.client.generate(PROMPT, max_tokens=8, temperature=0.0)
    for sent in (ids, ids[1:]):  # as smg's chat path sends it (BOS rendered), and as its completions path does
        (done,) = engine.Generate(_request(sent, temperature=0.0, max_tokens=8), timeout=30)
        assert list(done.complete.output_ids) == list(native.token_ids)
        assert done.complete.prompt_tokens == len(ids) == native.usage.prompt_tokens


def test_max_req_input_len_leaves_room_for_the_bos_and_one_over_it_is_refused_naming_it(server: RunningCluster,
                                                                                       engine) -> None:
    """GetModelInfo said max_model_len - 1, yet that many ids without the BOS were refused as one token longer than
    sent (the replica puts the BOS first): the advertised limit now holds for any ids, and the refusal counts both."""
    info = engine.GetModelInfo(vpb.GetModelInfoRequest(), timeout=5)
    limit = info.max_req_input_len
    assert limit == info.max_context_length - 2
    body = [400 + i % 30 for i in range(limit + 1)]  # no BOS first
    (done,) = engine.Generate(_request(body[:limit], temperature=0.0, max_tokens=1), timeout=60)
    assert done.complete.prompt_tokens == limit + 1 and len(done.complete.output_ids) == 1
    with pytest.raises(grpc.RpcError) as refused:
        list(engine.Generate(_request(body, temperature=0.0, max_tokens=1), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == (
        f"tokenized.input_ids has {limit + 1} tokens, and with the BOS this server puts first (as its own encoding "
        f"of text starts) {limit + 2}; a prompt must be shorter than max_model_len={info.max_context_length} "
        f"(GetModelInfo's max_req_input_len: {limit})")
