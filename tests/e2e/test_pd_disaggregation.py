"""Prefill/decode disaggregation behind a real gateway: ``smg --pd-disaggregation`` over one prefill
(``kv_producer``) and one decode (``kv_consumer``) replica of stories260k, at tp 1 and at tp 2 on both.

The gateway sends each request to the prefill replica (one token, ``do_remote_decode``), then to
the decode replica with the prefill's kv_transfer_params_json; the decode replica's ranks pull the
prompt's full blocks from the prefill's ranks (rank i from rank i) and compute only what follows.
Tokens are checked against the prefill replica alone (its native API, no transfer), which the
goldens tests check against transformers. The last test of each fleet kills its prefill replica.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import openai
import pytest

from coordinator.tokenizer import Tokenizer
from tests.e2e.cluster import RunningCluster
from tests.e2e.gateway import RunningGateway, as_gateway_decodes, model_with_chat_template, run_pd_gateway
from tests.e2e.pd import LONG_PROMPT, computed_prompt_tokens, labelled, serve_role, used_tokens
from tests.paths import STORIES_DIR, requires_stories

pytestmark = [pytest.mark.e2e, requires_stories]

BLOCK_SIZE = 16
PROMPTS = ["Once upon a time", LONG_PROMPT]
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat who found a red ball in the garden."}]


@dataclass
class PDFleet:
    prefill: RunningCluster
    decode: RunningCluster
    gateway: RunningGateway
    client: openai.OpenAI
    tokenizer: Tokenizer
    model: str


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDFleet]:
    tp = request.param
    tmp = tmp_path_factory.mktemp(f"pd-tp{tp}")
    model = model_with_chat_template(STORIES_DIR, tmp / "stories260k")
    with ExitStack() as stack:
        prefill = stack.enter_context(serve_role(model, tp, "kv_producer", "prefill-0", tmp / "prefill.log"))
        decode = stack.enter_context(serve_role(model, tp, "kv_consumer", "decode-0", tmp / "decode.log"))
        gateway = stack.enter_context(run_pd_gateway([prefill.target], [decode.target], tmp / "smg.log"))
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        yield PDFleet(prefill, decode, gateway, client, Tokenizer.from_pretrained(model), model.name)


def test_gateway_pairs_on_the_connector_fields(fleet: PDFleet) -> None:
    workers = {w["worker_type"]: w for w in fleet.gateway.workers()}
    assert (workers["prefill"]["kv_connector"], workers["prefill"]["kv_role"], workers["prefill"]["kv_engine_id"]) \
        == ("NixlConnector", "kv_producer", "prefill-0")
    assert (workers["decode"]["kv_role"], workers["decode"]["kv_engine_id"]) == ("kv_consumer", "decode-0")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_equal_one_replica_and_compute_at_most_one_block(fleet: PDFleet, prompt: str) -> None:
    num_prompt = len(fleet.tokenizer.encode(prompt))
    native = fleet.prefill.client.generate(prompt, max_tokens=24, temperature=0.0)
    computed, received = computed_prompt_tokens(fleet.decode), labelled(
        fleet.decode, "tpserve:kv_transfer_blocks_total", direction="received", transport="tcp")
    whole = fleet.client.completions.create(model=fleet.model, prompt=prompt, max_tokens=24, temperature=0)
    assert whole.choices[0].text == as_gateway_decodes(native.text)
    assert whole.usage.prompt_tokens == num_prompt == native.usage.prompt_tokens
    # The decode replica computed only what follows the prompt's last full block (and pulled the rest).
    assert computed_prompt_tokens(fleet.decode) - computed == num_prompt - (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert computed_prompt_tokens(fleet.decode) - computed <= BLOCK_SIZE
    assert labelled(fleet.decode, "tpserve:kv_transfer_blocks_total", direction="received", transport="tcp") \
        - received == (num_prompt - 1) // BLOCK_SIZE
    stream = fleet.client.completions.create(model=fleet.model, prompt=prompt, max_tokens=24, temperature=0,
                                             stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == as_gateway_decodes(native.text)


def test_seeded_sampling_equals_one_replica(fleet: PDFleet) -> None:
    native = fleet.prefill.client.generate(LONG_PROMPT, max_tokens=20, temperature=0.9, seed=7)
    out = fleet.client.completions.create(model=fleet.model, prompt=LONG_PROMPT, max_tokens=20, temperature=0.9,
                                          seed=7)
    assert out.choices[0].text == as_gateway_decodes(native.text)


def test_chat_greedy_and_seeded_equal_one_replica(fleet: PDFleet) -> None:
    for sampling in (dict(temperature=0.0), dict(temperature=0.8, seed=3)):
        native = fleet.prefill.client.generate(MESSAGES, max_tokens=24, **sampling)
        chat = fleet.client.chat.completions.create(model=fleet.model, messages=MESSAGES, max_tokens=24, **sampling)
        assert chat.choices[0].message.content == as_gateway_decodes(native.text)
        assert chat.usage.prompt_tokens == native.usage.prompt_tokens


def test_the_prefill_replica_frees_its_blocks_once_the_decode_side_confirms(fleet: PDFleet) -> None:
    fleet.client.completions.create(model=fleet.model, prompt=LONG_PROMPT + " once more", max_tokens=4, temperature=0)
    deadline = time.monotonic() + 5.0
    while labelled(fleet.prefill, "tpserve:kv_transfer_holds") != 0:
        assert time.monotonic() < deadline, "the prefill replica still holds blocks 5 s after the pull"
        time.sleep(0.05)
    sent = labelled(fleet.prefill, "tpserve:kv_transfer_blocks_total", direction="sent", transport="tcp")
    received = labelled(fleet.decode, "tpserve:kv_transfer_blocks_total", direction="received", transport="tcp")
    assert sent == received > 0
    assert labelled(fleet.decode, "tpserve:kv_transfer_fallbacks_total", reason="failed") == 0
    # Every block is free again on both sides (the pulled ones stay cached, unheld).
    assert used_tokens(fleet.prefill) == used_tokens(fleet.decode) == 0


def test_killing_the_prefill_replica_after_the_handoff_loses_no_stream(fleet: PDFleet) -> None:
    """The last test of its fleet: its prefill replica is gone afterwards."""
    import os
    import signal

    native = fleet.decode.client.generate(LONG_PROMPT, max_tokens=120, temperature=0.0, ignore_eos=True)
    stream = fleet.client.completions.create(model=fleet.model, prompt=LONG_PROMPT, max_tokens=120, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    texts = []
    for chunk in stream:  # the hand-off is over once the decode replica streams
        texts.append(chunk.choices[0].text if chunk.choices else "")
        if len(texts) == 2:
            os.killpg(fleet.prefill.process.pid, signal.SIGKILL)
            fleet.prefill.process.wait(10)
    assert "".join(texts) == as_gateway_decodes(native.text)
