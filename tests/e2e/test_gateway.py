"""A real gateway (``smg`` from PyPI) over two tp-1 replicas of stories260k, used with the real ``openai`` client.

The gateway tokenizes, renders the chat template and detokenizes itself, then routes
token ids to a replica over the engine protocol (coordinator/vllm_engine_service.py).
Its answers are checked against the same replicas' native API on the same token ids
(the native API is checked against transformers by the goldens tests). Every test
shares one gateway and one pair of replicas.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from coordinator.tokenizer import Tokenizer
from tests.e2e.cluster import RunningCluster, serve
from tests.e2e.gateway import RunningGateway, as_gateway_decodes, model_with_chat_template, run_gateway
from tests.paths import STORIES_DIR, requires_stories

pytestmark = [pytest.mark.e2e, requires_stories]

PROMPTS = ["Once upon a time", "The little dog", "Tom and Lily went to the park"]
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
          "additionalProperties": False}


@dataclass
class Fleet:
    replicas: list[RunningCluster]
    gateway: RunningGateway
    client: openai.OpenAI
    tokenizer: Tokenizer
    model: str

    def loads(self) -> list[vpb.SchedulerLoad]:
        """Each replica's GetLoads, by the engine protocol."""
        out = []
        for replica in self.replicas:
            with grpc.insecure_channel(replica.target) as channel:
                out.append(vllm_engine_pb2_grpc.VllmEngineStub(channel).GetLoads(vpb.GetLoadsRequest(), timeout=5)
                           .loads[0])
        return out

    def prompt_ids(self, text: str) -> list[int]:
        """The token ids a completions prompt has on both paths: the server's encoding, BOS included.
        smg encodes a completions prompt without special tokens and sends the text beside the ids;
        the engine service puts the BOS back (coordinator/vllm_engine_params.py)."""
        return self.tokenizer.encode(text)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("gateway")
    model = model_with_chat_template(STORIES_DIR, tmp / "stories260k")
    with ExitStack() as stack:
        # Each in a process group of its own, which the last test kills.
        replicas = [stack.enter_context(serve(model, 1, log_path=tmp / f"replica{i}.log", new_session=True))
                    for i in range(2)]
        gateway = stack.enter_context(run_gateway([r.target for r in replicas], tmp / "smg.log",
                                                  "--policy", "round_robin"))
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        yield Fleet(replicas, gateway, client, Tokenizer.from_pretrained(model), model.name)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_equal_native_generate_streamed_and_not(fleet: Fleet, prompt: str) -> None:
    native = fleet.replicas[0].client.generate(prompt, max_tokens=24, temperature=0.0)  # the same text both ways
    whole = fleet.client.completions.create(model=fleet.model, prompt=prompt, max_tokens=24, temperature=0)
    assert whole.choices[0].text == as_gateway_decodes(native.text)
    assert whole.choices[0].finish_reason == native.finish_reason
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == \
        (native.usage.prompt_tokens, native.usage.completion_tokens)
    assert native.usage.prompt_tokens == len(fleet.prompt_ids(prompt))  # the BOS counted on both paths
    stream = fleet.client.completions.create(model=fleet.model, prompt=prompt, max_tokens=24, temperature=0,
                                             stream=True)
    deltas = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert "".join(deltas) == as_gateway_decodes(native.text)
    assert len([d for d in deltas if d]) > 1


def test_chat_equals_native_chat(fleet: Fleet) -> None:
    native = fleet.replicas[1].client.generate(MESSAGES, max_tokens=32, temperature=0.0)
    chat = fleet.client.chat.completions.create(model=fleet.model, messages=MESSAGES, max_tokens=32, temperature=0)
    assert chat.choices[0].message.content == as_gateway_decodes(native.text)
    assert chat.usage.prompt_tokens == native.usage.prompt_tokens  # the same template, rendered twice


def test_chat_logprobs_equal_native_logprobs(fleet: Fleet) -> None:
    native = fleet.replicas[0].client.generate(MESSAGES, max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=2)
    chat = fleet.client.chat.completions.create(model=fleet.model, messages=MESSAGES, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in native.logprobs], abs=1e-5)
    assert [t.logprob for c in content for t in c.top_logprobs] == \
        pytest.approx([t.logprob for lp in native.logprobs for t in lp.top_logprobs], abs=1e-5)
    assert [c.token for c in content] == [fleet.tokenizer.decode([lp.token_id]) for lp in native.logprobs]


def test_stop_strings_and_max_tokens(fleet: Fleet) -> None:
    native = fleet.replicas[1].client.generate(PROMPTS[0], max_tokens=40, temperature=0.0, stop=[" named"])
    assert native.finish_reason == "stop"
    out = fleet.client.completions.create(model=fleet.model, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                          stop=[" named"])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (as_gateway_decodes(native.text), "stop")
    short = fleet.client.completions.create(model=fleet.model, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert (short.usage.completion_tokens, short.choices[0].finish_reason) == (3, "length")


def test_json_schema_response_format(fleet: Fleet) -> None:
    native = fleet.replicas[0].client.generate(MESSAGES, max_tokens=48, temperature=0.0, json_schema=SCHEMA)
    chat = fleet.client.chat.completions.create(
        model=fleet.model, messages=MESSAGES, max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}})
    text = chat.choices[0].message.content
    assert text == as_gateway_decodes(native.text)
    if chat.choices[0].finish_reason == "stop":  # a finished object is valid under the schema
        assert set(json.loads(text)) == {"name"}
    else:
        assert text.startswith('{"name":"')


def test_n_completions_are_the_seeded_native_samples(fleet: Fleet) -> None:
    out = fleet.client.completions.create(model=fleet.model, prompt=PROMPTS[1], max_tokens=16, temperature=1.0,
                                          seed=11, n=2)
    texts = {choice.index: choice.text for choice in out.choices}
    native = [fleet.replicas[0].client.generate(PROMPTS[1], max_tokens=16, temperature=1.0, seed=11 + i).text
              for i in (0, 1)]
    assert texts == {0: as_gateway_decodes(native[0]), 1: as_gateway_decodes(native[1])}


def test_a_bad_request_is_a_4xx_with_the_message(fleet: Fleet) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        fleet.client.completions.create(model=fleet.model, prompt=PROMPTS[0], max_tokens=-1)
    assert info.value.status_code == 400 and "max_tokens" in str(info.value)
    # Refused by the replica (INVALID_ARGUMENT), not the gateway: its message comes through.
    with pytest.raises(openai.BadRequestError) as info:
        fleet.client.completions.create(model=fleet.model, prompt=PROMPTS[0], max_tokens=4, top_p=1.5)
    assert "top_p" in str(info.value)


def test_a_client_that_disconnects_frees_the_replicas_blocks(fleet: Fleet) -> None:
    stream = fleet.client.completions.create(model=fleet.model, prompt=PROMPTS[2], max_tokens=400, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    for _, _ in zip(range(3), stream):
        pass
    assert sum(load.num_running_reqs for load in fleet.loads()) == 1
    stream.close()
    closed = time.monotonic()
    while True:
        loads = fleet.loads()
        if all(load.num_used_tokens == 0 and load.num_running_reqs == 0 for load in loads):
            break
        assert time.monotonic() - closed < 2.0, f"blocks still held 2 s after the client left: {loads}"
        time.sleep(0.05)


WORDS = ("cat", "dog", "sun", "big", "red", "ran", "happy", "tree", "ball", "girl", "boy", "park", "blue", "jump",
         "play", "fish", "bird", "cake", "home", "rain", "moon", "star", "toy", "car", "hat", "box", "mom", "dad")


def _multi_turn(fleet: Fleet, gateway: RunningGateway, seed: int, concurrency: int) -> tuple[float, list[float], int]:
    """16 sessions, each a prefix of its own (300 tokens or more) and 4 turns (each turn's prompt
    the previous one plus a few words), ``concurrency`` sessions at a time through ``gateway``.

    Each turn is a chat request, whose template starts it with the BOS on the gateway's side too:
    smg's event-driven ``cache_aware`` matches the blocks of our KV events against its own token
    ids, and for a completions prompt those lack the BOS the replica puts in front
    (coordinator/vllm_engine_params.py), so they would never match (docs/design/request-path.md, "The engine protocol
    a gateway routes").

    Returns:
        The prefix-cache hits (tokens) the replicas' metrics counted, the prompt tokens each
        replica received, and the most hits possible (every turn finding the full blocks it
        shares with the session's previous turn).
    """
    import random
    from concurrent.futures import ThreadPoolExecutor

    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    rng = random.Random(seed)
    prompts = []
    for _ in range(16):
        text = " ".join(rng.choice(WORDS) for _ in range(140))  # over 300 tokens of stories260k
        prompts.append([text := text + " " + " ".join(rng.choice(WORDS) for _ in range(6)) for _ in range(4)])
    ideal = 0
    for turns in prompts:
        ids = [fleet.tokenizer.encode(f"<s>user: {turn}\nassistant:", parse_special_tokens=True) for turn in turns]
        assert len(ids[0]) >= 300 and ids[0][:2] == [fleet.tokenizer.bos_token_id, ids[1][1]]  # one BOS
        for before, after in zip(ids, ids[1:]):
            common = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), len(before))
            ideal += common // 16 * 16

    def session(index: int) -> None:
        for prompt in prompts[index]:
            client.chat.completions.create(model=fleet.model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=1, temperature=0)

    def counters() -> tuple[float, list[float]]:
        hits = sum(r.metric("tpserve:prefix_cache_hits_total") for r in fleet.replicas)
        return hits, [r.metric("tpserve:prompt_tokens_total") for r in fleet.replicas]

    hits_before, prompt_before = counters()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(session, range(16)))
    hits_after, prompt_after = counters()
    return hits_after - hits_before, [a - b for a, b in zip(prompt_after, prompt_before)], ideal


def test_cache_aware_routing_finds_the_sessions_prefixes(fleet: Fleet, tmp_path: Path) -> None:
    """With cache_aware, (nearly) every turn lands where its session's previous turn left its
    blocks, whatever the interleaving. round_robin, one session after the other (so that its count is
    not left to chance), sends each turn to the other replica: turns 3 and 4 find only what
    turns 1 and 2 left, about 2/3 of what could be found. (Four turns over two replicas bound
    the ratio: round_robin always finds something.)"""
    round_robin, _, rr_ideal = _multi_turn(fleet, fleet.gateway, seed=1, concurrency=1)
    with run_gateway([r.target for r in fleet.replicas], tmp_path / "smg-cache-aware.log",
                     "--policy", "cache_aware") as gateway:
        cache_aware, per_replica, ideal = _multi_turn(fleet, gateway, seed=2, concurrency=16)
    print(f"prefix-cache hits: cache_aware {cache_aware:.0f} of {ideal}, round_robin {round_robin:.0f} of "
          f"{rr_ideal}; prompt tokens per replica with cache_aware {per_replica}")
    # Measured: cache_aware 92 to 100 % of the ideal, round_robin 65 %; a replica 22 to 50 % of the prompts.
    assert cache_aware >= 0.85 * ideal
    assert cache_aware / ideal >= 1.2 * round_robin / rr_ideal
    assert min(per_replica) >= 0.1 * sum(per_replica)  # both replicas served sessions


def test_a_killed_replica_costs_no_request_and_hangs_none(fleet: Fleet) -> None:
    """kill -9 of one replica's process group under a steady stream of requests: the gateway
    retries on the other replica (and its breaker and health checks drop the dead one), so
    every request succeeds and none hangs. Runs last: the fleet has one replica afterwards."""
    import os
    import signal
    import threading

    results: list[tuple[float, float, str]] = []  # (start, seconds, outcome)
    stop = threading.Event()

    def stream_of_requests() -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                out = fleet.client.completions.create(model=fleet.model, prompt=PROMPTS[0], max_tokens=8,
                                                      temperature=0, timeout=20)
                outcome = out.choices[0].finish_reason
            except openai.OpenAIError as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            results.append((start, time.monotonic() - start, outcome))

    threads = [threading.Thread(target=stream_of_requests) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    killed = time.monotonic()
    os.killpg(fleet.replicas[1].process.pid, signal.SIGKILL)
    time.sleep(4.0)
    stop.set()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "a request hung"
    after = [r for r in results if r[0] > killed]
    assert len(after) >= 10 and len([r for r in results if r[0] < killed]) >= 2
    assert [r for r in results if r[2] != "length"] == []  # every request, before and after the kill
    assert max(seconds for _, seconds, _ in results) < 10
