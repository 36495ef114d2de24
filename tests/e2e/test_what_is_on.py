"""A server says what is on: one ``serving`` log line with the whole serving configuration, and
``GetModelInfo`` / ``tpserve info`` with quantization, speculative decoding, prefix caching and the
version. The stream yields typed chunks that add up to the unary result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster import child_pids, serve
from tpserve import __version__
from tpserve.client import GenerateStream, StreamChunk, Usage

pytestmark = pytest.mark.e2e

#: What a Prometheus 2.x server sends by default (scrape_protocols: OpenMetrics 1.0.0 first).
PROMETHEUS_2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                       "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


@pytest.fixture(scope="module")
def int8_ngram(tmp_path_factory):
    log = tmp_path_factory.mktemp("what_is_on") / "serve.log"
    with serve(None, 1, "--quantization", "int8", "--speculative-method", "ngram", "--num-speculative-tokens", "2",
               "--prompt-lookup-max", "3", "--prompt-lookup-min", "1", "--num-gpu-blocks-override", "64",
               log_path=log) as cluster:
        yield cluster, log


def test_model_info_and_tpserve_info_say_what_is_on(int8_ngram):
    cluster, _ = int8_ngram
    info = cluster.client.model_info()
    assert (info.quantization, info.speculative_method, info.num_speculative_tokens) == ("int8", "ngram", 2)
    assert info.enable_prefix_caching and info.server_version == __version__
    assert not info.async_scheduling  # not with speculative decoding (a proposal needs the tokens first)
    assert (info.dtype, info.num_kv_blocks, info.block_size) == ("float32", 64, 16)
    printed = subprocess.run([sys.executable, "-m", "launch.cli", "info", "--target", cluster.target],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    shown = json.loads(printed)
    assert {k: shown[k] for k in ("quantization", "speculative_method", "num_speculative_tokens",
                                  "enable_prefix_caching", "server_version")} == {
        "quantization": "int8", "speculative_method": "ngram", "num_speculative_tokens": 2,
        "enable_prefix_caching": True, "server_version": __version__}


def test_one_serving_line_lists_the_configuration(int8_ngram):
    cluster, log = int8_ngram
    lines = [line for line in log.read_text(errors="replace").splitlines() if " serving " in line]
    assert len(lines) == 1, lines
    line = lines[0]
    for field in ("dtype=float32", "quantization=int8", "tensor_parallel_size=1", "nnodes=1", "num_kv_blocks=64",
                  "kv_cache_tokens=1024", "kv_cache_layout=per_head:2x4x16", "max_model_len=512", "enable_prefix_caching=True",
                  "speculative_method=ngram", "num_speculative_tokens=2", "async_scheduling=off", "event_loop=uvloop", "sched_policy=batch", "tls=off",
                  "api_key=off", "otlp_traces_endpoint=off",
                  f"address=127.0.0.1:{cluster.port}",
                  f"metrics_url=http://127.0.0.1:{cluster.metrics_port}/metrics", f"version={__version__}",
                  "served_model_name=tpserve-tiny-stories"):
        assert field in line, (field, line)


def test_stream_yields_typed_chunks_that_add_up_to_the_result(int8_ngram):
    cluster, _ = int8_ngram
    result = cluster.client.generate("Once upon a time", max_tokens=24, temperature=0)
    stream = cluster.client.generate_stream("Once upon a time", max_tokens=24, temperature=0)
    assert isinstance(stream, GenerateStream)
    chunks = list(stream)
    assert all(isinstance(c, StreamChunk) for c in chunks) and len(chunks) > 1
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == result.finish_reason == "length"
    assert chunks[-1].usage == Usage(result.usage.prompt_tokens, 24, chunks[-1].usage.cached_prompt_tokens)
    assert "".join(c.text for c in chunks) == result.text
    assert [t for c in chunks for t in c.token_ids] == result.token_ids


def _thread_policies(pid: int) -> set[int]:
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="scheduling policies are set on Linux only")
def test_the_coordinator_runs_under_sched_batch_and_its_ranks_do_not(int8_ngram):
    """tpserve/sched_policy.py: every thread of the coordinator SCHED_BATCH (its wakeups do not preempt its
    own event loop), every thread of a rank SCHED_OTHER although a child process inherits its parent's."""
    cluster, _ = int8_ngram
    cluster.client.generate("Once upon a time", max_tokens=4, temperature=0)  # every thread started
    ranks = child_pids(cluster.process.pid)
    assert len(ranks) == 1, ranks
    assert _thread_policies(cluster.process.pid) == {os.SCHED_BATCH}
    assert _thread_policies(ranks[0]) == {os.SCHED_OTHER}


def test_metrics_port_0_reports_the_port_it_bound(tmp_path):
    """``--metrics-port 0`` binds a port the system chooses: the ``serving`` line names that port (it said
    ``localhost:0``), on ``--host``'s address (127.0.0.1 here), and /metrics answers there."""
    import re
    import urllib.request

    log = tmp_path / "serve.log"
    with serve(None, 1, "--metrics-port", "0", log_path=log):  # the last --metrics-port given wins
        line = next(line for line in log.read_text(errors="replace").splitlines() if " serving " in line)
        port = int(re.search(r"metrics_url=http://127\.0\.0\.1:(\d+)/metrics", line).group(1))
        assert port != 0
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "tpserve:num_requests_running" in body
        # Prometheus 2.x's Accept header: prometheus_client >= 0.23 wrote its samples as tpserve_saturation
        # (client_python#1177), not the names the autoscaling rules query; the text format keeps the colons.
        scrape = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": PROMETHEUS_2_ACCEPT})
        with urllib.request.urlopen(scrape, timeout=5) as answer:
            assert answer.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            body = answer.read().decode()
        samples = {s.name for family in text_string_to_metric_families(body) for s in family.samples}
        assert {"tpserve:saturation", "tpserve:num_requests_waiting", "vllm:num_requests_waiting"} <= samples
        assert not any(name.startswith(("tpserve_", "vllm_")) for name in samples), sorted(samples)[:5]
