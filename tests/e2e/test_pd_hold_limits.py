"""A producer replica's hand-offs and side channel at the edges: holds capped per tenant and in all (F3),
the load gauges once holds end (F4), and the side channel's start-up refusals in one line (F7).

One tp-1 ``kv_producer`` replica of stories260k with a 64-block pool, two API-key tenants, and hand-offs
that nobody pulls (no decode replica): what ``repro/hold_exhaustion.py`` and ``stale_usage_gauge.sh`` did.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from coordinator.tokenizer import Tokenizer
from tests.e2e.cluster import RunningCluster, free_port
from tests.e2e.pd import LONG_PROMPT, engine_generate, free_port_range, kv_transfer_config, labelled, serve_role
from tests.paths import STORIES_DIR, requires_stories

pytestmark = [pytest.mark.e2e, requires_stories]

KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-0123456789"
NUM_BLOCKS, HOLD_TIMEOUT_S = 64, 3.0


@pytest.fixture(scope="module")
def producer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningCluster, Tokenizer]]:
    tmp = tmp_path_factory.mktemp("pd-holds")
    (tmp / "keys").write_text(f"{KEY_A}\n{KEY_B}\n")
    with serve_role(STORIES_DIR, 1, "kv_producer", "p", tmp / "prefill.log", "--api-key-file", str(tmp / "keys"),
                    "--num-gpu-blocks-override", str(NUM_BLOCKS), hold_timeout_s=HOLD_TIMEOUT_S,
                    max_hold_fraction=0.5, max_hold_fraction_per_tenant=0.25) as replica:
        yield replica, Tokenizer.from_pretrained(STORIES_DIR)


def _hand_over(replica: RunningCluster, key: str, prompt: list[int]) -> dict:
    out = engine_generate(replica, prompt, {"do_remote_decode": True, "do_remote_prefill": False}, 1, key,
                          ignore_eos=True)
    return json.loads(out.kv_transfer_params_json)


def _usage(replica: RunningCluster) -> float:
    return labelled(replica, "tpserve:kv_cache_usage_perc")


def test_unpulled_hand_offs_are_capped_per_tenant_and_the_gauges_follow_their_end(producer) -> None:
    """F3 and F4. A tenant's unpulled hand-offs stop at a quarter of the pool (16 blocks) with RESOURCE_EXHAUSTED
    and pushback; another tenant still hands over; once the holds time out the usage gauge is back near 0
    without any further request."""
    replica, tokenizer = producer
    prompt = tokenizer.encode(f"Caps. {LONG_PROMPT}")
    blocks = (len(prompt) - 1) // 16
    held = 0
    with pytest.raises(grpc.RpcError) as info:
        for i in range(NUM_BLOCKS):
            _hand_over(replica, KEY_A, tokenizer.encode(f"Caps {i}. {LONG_PROMPT}"))
            held += blocks
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_hold_fraction_per_tenant" in info.value.details()
    assert dict(info.value.trailing_metadata() or ()).get("grpc-retry-pushback-ms") == "1000"
    assert held <= NUM_BLOCKS // 4 < held + blocks
    assert _hand_over(replica, KEY_B, prompt)["remote_block_ids"]  # the other tenant is not starved
    assert _usage(replica) > 0.2
    deadline = time.monotonic() + HOLD_TIMEOUT_S + 10
    while labelled(replica, "tpserve:kv_transfer_holds") or _usage(replica) > 0.05:
        assert time.monotonic() < deadline, f"usage {_usage(replica)} after every hold ended"
        time.sleep(0.2)
    assert labelled(replica, "tpserve:saturation") < 0.05


def _serve_fails(*flags: str) -> tuple[int, str]:
    """``tpserve serve`` that must refuse to start: its exit code and stderr."""
    done = subprocess.run([sys.executable, "-m", "launch.cli", "serve", "--model", str(STORIES_DIR), *flags],
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stderr


def test_a_side_channel_port_in_use_is_one_line_naming_the_field() -> None:
    """F7: a side channel port another process listens on fails in one line, no rank traceback (the server's own
    --port there, as the probe did, is refused with the configuration: tests/test_config.py)."""
    with socket.socket() as other:
        port = free_port()
        other.bind(("127.0.0.1", port))
        other.listen()
        code, err = _serve_fails("--host", "127.0.0.1", "--port", str(free_port()), "--metrics-port", str(free_port()),
                                 "--kv-transfer-config", kv_transfer_config("kv_both", port, "x"))
    assert code == 1 and "Traceback" not in err and "worker group lost" not in err
    assert (f"tpserve serve: --kv-transfer-config: kv_connector_extra_config.side_channel_port: 127.0.0.1:{port} "
            "(rank 0's: side_channel_port") in err and "is in use by another process" in err


def test_a_side_channel_host_not_on_this_machine_is_one_line_naming_the_field(tmp_path) -> None:
    (tmp_path / "secret").write_text("a-cluster-secret-of-enough-length")
    config = json.dumps({"kv_connector": "NixlConnector", "kv_connector_extra_config": {
        "side_channel_host": "192.0.2.7", "side_channel_port": free_port_range(1)}})
    code, err = _serve_fails("--host", "127.0.0.1", "--port", str(free_port()), "--metrics-port", str(free_port()),
                             "--cluster-secret-file", str(tmp_path / "secret"), "--kv-transfer-config", config)
    assert code == 1 and "Traceback" not in err
    assert "kv_connector_extra_config.side_channel_host 192.0.2.7 is not an address of this machine" in err


def test_a_side_channel_beyond_loopback_without_a_secret_does_not_start() -> None:
    config = json.dumps({"kv_connector": "NixlConnector", "kv_connector_extra_config": {"side_channel_host": "0.0.0.0"}})
    code, err = _serve_fails("--port", str(free_port()), "--kv-transfer-config", config)
    assert code == 2 and "side_channel_host 0.0.0.0 listens beyond loopback: give --cluster-secret-file" in err


def test_a_request_waiting_for_held_blocks_starts_when_the_holds_end(tmp_path) -> None:
    """F3's victim: with the caps lifted (max_hold_fraction 1), unpulled hand-offs fill the pool and another
    tenant's request waits; it used to wait on until a new request woke the engine (DEADLINE_EXCEEDED, as the
    probe saw), and now starts as soon as the holds end."""
    (tmp_path / "keys").write_text(f"{KEY_A}\n{KEY_B}\n")
    tokenizer = Tokenizer.from_pretrained(STORIES_DIR)
    with serve_role(STORIES_DIR, 1, "kv_producer", "p", tmp_path / "prefill.log", "--api-key-file",
                    str(tmp_path / "keys"), "--num-gpu-blocks-override", str(NUM_BLOCKS), hold_timeout_s=HOLD_TIMEOUT_S,
                    max_hold_fraction=1.0, max_hold_fraction_per_tenant=1.0) as replica:
        prompt = tokenizer.encode(f"Victim. {LONG_PROMPT}")
        blocks = (len(prompt) - 1) // 16
        for i in range(NUM_BLOCKS // blocks):  # the pool's blocks less fewer than the victim needs
            _hand_over(replica, KEY_A, tokenizer.encode(f"Filler {i}. {LONG_PROMPT}"))
        assert _usage(replica) > 0.9
        started = time.monotonic()
        out = engine_generate(replica, prompt, None, 32, KEY_B, ignore_eos=True)
        waited = time.monotonic() - started
    assert len(out.output_ids) == 32
    assert 1.0 < waited < HOLD_TIMEOUT_S + 8, f"the request waited {waited:.1f} s for blocks freed after {HOLD_TIMEOUT_S} s"
