"""Refusals are visible to an operator: ``tpserve:rpc_errors_total{method, code}`` and a warning line per status
code (coordinator/errors.py ``ErrorCount``). A shedding replica's RESOURCE_EXHAUSTED and a client's INVALID_ARGUMENT
showed in no metric and no log line; an SRE could not alert on a rejection rate.
"""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster import serve
from tpserve.client import build_request
from tpserve.v1 import generate_pb2_grpc

pytestmark = pytest.mark.e2e

GENERATE = "/tpserve.v1.Generation/Generate"


def _errors(metrics_port: int) -> dict[tuple[str, str], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return {(s.labels["method"], s.labels["code"]): s.value
            for family in text_string_to_metric_families(body) if family.name == "tpserve:rpc_errors"
            for s in family.samples if s.name == "tpserve:rpc_errors_total"}


def test_refusals_are_counted_by_method_and_code_and_logged_without_the_request(tmp_path) -> None:
    log = tmp_path / "serve.log"
    with serve(None, 1, "--max-num-seqs", "1", "--max-queue-len", "1", log_path=log) as cluster:
        stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(cluster.target))  # no client retries

        def call(**fields) -> grpc.StatusCode:
            try:
                stub.Generate(build_request("secret prompt words", **fields), timeout=60)
            except grpc.RpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        # Six at once: one runs (400 tokens, a second or more), one waits in the queue's one place, four are refused.
        with ThreadPoolExecutor(6) as pool:
            codes = list(pool.map(lambda _: call(max_tokens=400, ignore_eos=True), range(6)))
        bad = [call(max_tokens=1, temperature=-1.0) for _ in range(2)]
        counted = _errors(cluster.metrics_port)
    assert sorted(code.name for code in codes) == ["OK", "OK"] + ["RESOURCE_EXHAUSTED"] * 4
    assert bad == [grpc.StatusCode.INVALID_ARGUMENT] * 2
    assert counted == {(GENERATE, "RESOURCE_EXHAUSTED"): 4, (GENERATE, "INVALID_ARGUMENT"): 2}
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if "request refused: " in line]
    # One line per code within the rate limit's window (tpserve/log.py), the queue's reason but no request's text.
    assert any("request refused: RESOURCE_EXHAUSTED" in line and "queue is full" in line for line in lines), lines
    assert any("request refused: INVALID_ARGUMENT" in line for line in lines), lines
    assert "secret prompt words" not in text
