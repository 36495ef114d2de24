"""kv_transfer_params_json: the NIXL connector's hand-off fields read at the edge, and the hashes a
transfer's blocks are checked by."""

from __future__ import annotations

import json

import pytest

from coordinator.errors import InvalidArgumentError
from coordinator.kv_cache_manager import extend_block_hashes, prompt_block_hashes
from coordinator.kv_transfer.params import KVTransferParams, handoff_json, parse_params
from coordinator.sequence import Sequence, StopParams
from tpserve.step import SamplingParams


def test_what_the_gateway_sends_a_prefill_replica() -> None:
    assert parse_params('{"do_remote_decode":true,"do_remote_prefill":false}') == \
        KVTransferParams(do_remote_decode=True)


def test_the_hand_off_round_trips() -> None:
    text = handoff_json("p0", "10.0.0.7", 5600, [3, 9], "ab" * 16, 2, 16, "int8")
    assert json.loads(text) == {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0",
                                "remote_block_ids": [3, 9], "remote_host": "10.0.0.7", "remote_port": 5600,
                                "remote_request_id": "ab" * 16, "tp_size": 2, "block_size": 16,
                                "kv_cache_dtype": "int8"}
    assert parse_params(text) == KVTransferParams(False, True, "p0", "10.0.0.7", 5600, [3, 9], "ab" * 16, 2, 16,
                                                  "int8")
    # A hand-over from a replica that did not send its cache type (an earlier release) is read as "not said".
    assert parse_params(json.dumps({**json.loads(text), "kv_cache_dtype": None})).kv_cache_dtype == ""


@pytest.mark.parametrize(("text", "message"), [
    ("[]", "kv_transfer_params_json must be a JSON object"),
    ('{"remote_port": "80"}', "kv_transfer_params_json.remote_port must be a JSON int, got str"),
    ('{"tp_size": true}', "kv_transfer_params_json.tp_size must be a JSON int, got bool"),
    ('{"remote_block_ids": [1, -2]}', "remote_block_ids must be at most 65536 block ids in [0, 2^31)"),
    ('{"do_remote_prefill": true, "remote_block_ids": [1], "remote_host": "h", "remote_port": 1}',
     "remote_request_id must name the prefill replica's hold"),
])
def test_bad_fields_are_invalid_argument_naming_them(text: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        parse_params(text)
    assert message in str(info.value)


def test_a_remote_prefill_without_blocks_needs_no_side_channel() -> None:
    assert parse_params('{"do_remote_prefill": true, "remote_block_ids": []}').do_remote_prefill


@pytest.mark.parametrize("namespace", [b"", b"n" * 32])
def test_a_requests_block_hashes_are_the_prefix_caches(namespace: bytes) -> None:
    tokens = list(range(1, 40))
    seq = Sequence(seq_id=0, prompt_token_ids=tokens, sampling=SamplingParams(), stop=StopParams(8, (2,)),
                   max_model_len=512, cache_namespace=namespace)
    assert prompt_block_hashes(tokens, namespace, 16, 2) == extend_block_hashes(seq, 16, 32)
    assert prompt_block_hashes(tokens, namespace, 16, 9) == extend_block_hashes(seq, 16, 39)  # full blocks only
