"""A KV transfer between replicas with an 8-bit cache (``--kv-cache-dtype int8``): the decode replica pulls the
prompt's full blocks, codes and per-token scale pools (worker/kv_transfer/blocks.py), and completes with exactly
the tokens of the prefill replica alone. A decode replica whose cache stores another type (fp8) refuses the
blocks at the pull (the layout check: ``ModelRunner.kv_codec``), prefills locally and answers with its own
cache's tokens. Three tp-1 replicas of stories260k, driven by the engine protocol as ``smg --pd-disaggregation``
drives them (tests/e2e/test_pd_disaggregation.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from coordinator.tokenizer import Tokenizer
from tests.e2e.cluster import RunningCluster
from tests.e2e.pd import LONG_PROMPT, computed_prompt_tokens, engine_generate, labelled, serve_role, used_tokens
from tests.paths import STORIES_DIR, requires_stories

pytestmark = [pytest.mark.e2e, requires_stories]

BLOCK_SIZE = 16
HOLD_TIMEOUT_S = 60.0  # an unread hold's life on the prefill replica: a refused one must end long before


def _generate(replica: RunningCluster, prompt: list[int], kv: dict | None = None, max_tokens: int = 24,
              **sampling: object) -> vpb.GenerateComplete:
    return engine_generate(replica, prompt, kv, max_tokens, **sampling)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where each replica's log is written (``<name>.log``)."""
    return tmp_path_factory.mktemp("pd-kv8")


@pytest.fixture(scope="module")
def replicas(logs: Path) -> Iterator[dict[str, RunningCluster]]:
    tmp = logs
    with ExitStack() as stack:
        yield {name: stack.enter_context(serve_role(STORIES_DIR, 1, role, name, tmp / f"{name}.log",
                                                    "--kv-cache-dtype", dtype, **timeouts))
               for name, role, dtype, timeouts in (
                   ("prefill", "kv_producer", "int8", {"hold_timeout_s": HOLD_TIMEOUT_S}),
                   ("decode", "kv_consumer", "int8", {}), ("decode-fp8", "kv_consumer", "fp8", {}))}


def _hand_over(prefill: RunningCluster, prompt: list[int]) -> dict:
    """The prefill replica's kv_transfer_params for ``prompt``, as the gateway asks for them."""
    out = _generate(prefill, prompt, {"do_remote_decode": True, "do_remote_prefill": False}, max_tokens=1,
                    ignore_eos=True)
    return json.loads(out.kv_transfer_params_json)


def test_an_8_bit_cache_moves_with_its_scales_and_gives_one_replicas_tokens(replicas) -> None:
    prefill, decode = replicas["prefill"], replicas["decode"]
    prompt = Tokenizer.from_pretrained(STORIES_DIR).encode(f"Codes. {LONG_PROMPT}")
    full_blocks = (len(prompt) - 1) // BLOCK_SIZE
    assert full_blocks >= 3
    alone = _generate(prefill, prompt)  # the int8 cache on one replica: the reference
    kv = _hand_over(prefill, prompt)
    assert len(kv["remote_block_ids"]) == full_blocks
    computed = computed_prompt_tokens(decode)
    received = labelled(decode, "tpserve:kv_transfer_bytes_total", direction="received", transport="tcp")
    out = _generate(decode, prompt, kv)
    assert list(out.output_ids) == list(alone.output_ids)
    assert out.cached_tokens == full_blocks * BLOCK_SIZE  # pulled, not computed
    assert computed_prompt_tokens(decode) - computed == len(prompt) - full_blocks * BLOCK_SIZE
    # Each block: 5 layers x K and V x 16 positions x 4 KV heads x (8 one-byte codes + a 2-byte scale).
    block_bytes = 5 * 2 * 16 * 4 * (8 + 2)
    assert labelled(decode, "tpserve:kv_transfer_bytes_total", direction="received", transport="tcp") - received \
        == full_blocks * block_bytes
    assert used_tokens(decode) == 0 and used_tokens(prefill) == 0


def test_the_gateway_sees_each_replicas_cache_type(replicas) -> None:
    """GetServerInfo's ``kv_cache_dtype``, and a ``pairing_protocol`` that keeps 8-bit replicas of two types apart
    (``smg --pd-disaggregation`` pairs only replicas whose protocols match)."""
    def server_info(replica: RunningCluster) -> vpb.GetServerInfoResponse:
        with grpc.insecure_channel(replica.target) as channel:
            return vllm_engine_pb2_grpc.VllmEngineStub(channel).GetServerInfo(vpb.GetServerInfoRequest(), timeout=5)

    infos = {name: server_info(replica) for name, replica in replicas.items()}
    assert [infos[n].kv_cache_dtype for n in ("prefill", "decode", "decode-fp8")] == ["int8", "int8", "fp8"]
    assert infos["prefill"].pairing_protocol == infos["decode"].pairing_protocol == "tpserve-kv/tcp/tp1/kv-int8"
    assert infos["decode-fp8"].pairing_protocol == "tpserve-kv/tcp/tp1/kv-fp8"


def test_a_replica_of_another_8_bit_type_refuses_the_blocks_and_prefills_itself(replicas, logs: Path) -> None:
    """Refused by the decode replica before any pull (the hand-over names the prefill's --kv-cache-dtype), in one
    log line naming the flag; the prefill replica's hold ends at once, its blocks freed."""
    prefill, decode_fp8 = replicas["prefill"], replicas["decode-fp8"]
    prompt = Tokenizer.from_pretrained(STORIES_DIR).encode(f"Types. {LONG_PROMPT}")
    refused = labelled(decode_fp8, "tpserve:kv_transfer_fallbacks_total", reason="refused")
    computed = computed_prompt_tokens(decode_fp8)
    kv = _hand_over(prefill, prompt)
    assert kv["kv_cache_dtype"] == "int8"
    out = _generate(decode_fp8, prompt, kv)
    assert labelled(decode_fp8, "tpserve:kv_transfer_fallbacks_total", reason="refused") == refused + 1
    assert out.cached_tokens == 0 and computed_prompt_tokens(decode_fp8) - computed == len(prompt)  # all computed
    lines = [line for line in (logs / "decode-fp8.log").read_text().splitlines() if "kv pull refused" in line]
    assert "the prefill replica's KV cache is --kv-cache-dtype int8, this replica's fp8: both need the same " \
           "--kv-cache-dtype" in lines[-1]
    # Its own fp8 cache's tokens: the same request again, served from the blocks that prefill cached (a
    # prefix hit gives a miss's tokens: test_kv_cache_dtype_serving.py), not the int8 replica's.
    again = _generate(decode_fp8, prompt)
    assert again.cached_tokens > 0 and list(out.output_ids) == list(again.output_ids)
    assert used_tokens(decode_fp8) == 0
    deadline = time.monotonic() + 5  # well before the hold's timeout (HOLD_TIMEOUT_S)
    while labelled(prefill, "tpserve:kv_transfer_holds") or used_tokens(prefill):
        assert time.monotonic() < deadline, "a refused transfer's hold was kept"
        time.sleep(0.1)
