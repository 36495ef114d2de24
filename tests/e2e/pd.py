"""Prefill and decode replicas for tests: ``tpserve serve --kv-transfer-config`` with free side-channel ports."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from tests.e2e.cluster import RunningCluster, free_port, serve

LONG_PROMPT = ("Once upon a time there was a little girl named Lily. She loved to play outside with her dog "
               "Max. One day they went to the park and saw a big tree with red apples. Lily wanted an apple "
               "but the tree was too tall. Max barked and ran around the tree. Then")


def free_port_range(count: int) -> int:
    """A port ``p`` with ``p .. p + count - 1`` all free now (a replica's ranks listen on consecutive ports)."""
    for _ in range(200):
        base = free_port()  # outside the ephemeral range (tests/e2e/cluster.py)
        if base + count > 32767:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def kv_transfer_config(role: str, port: int, engine_id: str, **extra: object) -> str:
    """``--kv-transfer-config`` JSON for a replica of ``role`` whose rank ``r`` listens on ``port + r``."""
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id,
                       "kv_connector_extra_config": {"side_channel_host": "127.0.0.1", "side_channel_port": port,
                                                     **extra}})


@contextmanager
def serve_role(model: Path, tp: int, role: str, engine_id: str, log_path: Path, *extra: str,
               **config: object) -> Iterator[RunningCluster]:
    """One replica of ``role`` (``kv_producer``, ``kv_consumer``, ``kv_both``) in a session of its own."""
    port = free_port_range(tp)
    with serve(model, tp, "--kv-transfer-config", kv_transfer_config(role, port, engine_id, **config), *extra,
               log_path=log_path, new_session=True) as replica:
        yield replica


def labelled(replica: RunningCluster, name: str, **labels: str) -> float:
    """One sample of ``name`` with exactly ``labels`` from the replica's /metrics (0 when absent)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{replica.metrics_port}/metrics", timeout=5).read().decode()
    want = "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""
    for line in body.splitlines():
        if line.startswith(name + want + " "):
            return float(line.split()[1])
    return 0.0


def used_tokens(replica: RunningCluster, operator_key: str = "") -> int:
    """GetLoads' tokens of the blocks held now (read from the allocator, not a gauge of the last step)."""
    metadata = [("authorization", f"Bearer {operator_key}")] if operator_key else None
    with grpc.insecure_channel(replica.target) as channel:
        return vllm_engine_pb2_grpc.VllmEngineStub(channel).GetLoads(vpb.GetLoadsRequest(), timeout=5,
                                                                     metadata=metadata).loads[0].num_used_tokens


def computed_prompt_tokens(replica: RunningCluster) -> float:
    """Prompt tokens the replica computed: looked up at admission less found (pulled blocks are found)."""
    return replica.metric("tpserve:prefix_cache_queries_total") - replica.metric("tpserve:prefix_cache_hits_total")


def engine_generate(replica: RunningCluster, prompt: list[int], kv: dict | None = None, max_tokens: int = 16,
                    key: str = "", **sampling: object) -> vpb.GenerateComplete:
    """One unstreamed engine-protocol Generate (greedy unless ``sampling`` says otherwise), as the tenant of the API
    ``key`` ("": none), with ``kv`` as its ``kv_transfer_params_json``; the GenerateComplete."""
    request = vpb.GenerateRequest(
        request_id=f"r{time.monotonic_ns()}", tokenized=vpb.TokenizedInput(input_ids=prompt),
        sampling_params=vpb.SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **sampling}))
    if kv is not None:
        request.kv_transfer_params_json = json.dumps(kv)
    metadata = [("authorization", f"Bearer {key}")] if key else None
    with grpc.insecure_channel(replica.target) as channel:
        return list(vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(request, timeout=60,
                                                                          metadata=metadata))[-1].complete
