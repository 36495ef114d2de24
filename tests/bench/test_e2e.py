"""``tpserve bench`` and the distributed Locust load against a live stories260k server at tp 2.

The references are the server's own accounting, read from its Prometheus endpoint
(tokens it generated, its TTFT and E2E histograms), and the requested lengths; the
Locust run's references are the master's CSV and the samples it logged per worker.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.e2e.cluster import free_port
from tpserve.bench import LOCUSTFILE
from tests.paths import STORIES_DIR, requires_stories

pytestmark = [pytest.mark.e2e, requires_stories]


@pytest.fixture(scope="module")
def cluster(shared_servers):
    """The shared stories260k server at tp 2 (tests/conftest.py): the checks read its counters as differences."""
    return shared_servers.get(STORIES_DIR, 2)


def server_counts(cluster) -> dict[str, float]:
    names = ("tpserve:generation_tokens_total", "tpserve:prompt_tokens_total",
             "tpserve:time_to_first_token_seconds_sum", "tpserve:e2e_request_latency_seconds_sum",
             "tpserve:e2e_request_latency_seconds_count")
    return {name: cluster.metric(name) for name in names}


def test_bench_against_live_server(cluster, tmp_path: Path) -> None:
    before = server_counts(cluster)
    result_file, plot_file = tmp_path / "bench.json", tmp_path / "bench.png"
    cmd = [sys.executable, "-m", "launch.cli", "bench", "--target", cluster.target, "--dataset", "random",
           "--num-prompts", "64", "--request-rate", "16", "--input-len", "24", "--output-len", "16",
           "--range-ratio", "0.5", "--ignore-eos", "--seed", "3", "--goodput", "e2el:60000",
           "--result-file", str(result_file), "--plot", str(plot_file), "--disable-tqdm"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    after = server_counts(cluster)

    def delta(name: str) -> float:
        return after[f"tpserve:{name}"] - before[f"tpserve:{name}"]

    assert "Serving Benchmark Result" in done.stdout and re.search(r"Successful requests:\s+64\n", done.stdout)
    data = json.loads(result_file.read_text())
    (run,) = data["runs"]
    summary, records = run["summary"], run["requests"]
    assert (summary["completed"], summary["failed"], summary["failures"]) == (64, 0, {})
    assert len(records) == 64 and [r["index"] for r in records] == list(range(64))
    # With ignore_eos every request generates exactly its max_tokens (8..24: 16 with ratio 0.5), and the
    # stream carried them all (no stop token to hold back).
    for r in records:
        assert r["status"] == "OK" and r["finish_reason"] == "length"
        assert r["completion_tokens"] == r["max_tokens"] == sum(r["chunk_num_tokens"])
        assert 8 <= r["max_tokens"] <= 24 and 12 <= r["prompt_tokens"] <= 36  # token-id prompts: no BOS added
    # The server's usage totals agree with the records, token for token.
    completion = sum(r["completion_tokens"] for r in records)
    assert delta("generation_tokens_total") == completion
    assert delta("prompt_tokens_total") == sum(r["prompt_tokens"] for r in records)
    assert summary["total_output_tokens"] == completion and summary["request_goodput"] == pytest.approx(
        summary["request_throughput"])
    # The client sends before the server sees a request and reads after it answers, so its
    # latencies are the server's plus transport: never less.
    assert delta("e2e_request_latency_seconds_count") == 64
    assert sum(r["ttft_s"] for r in records) >= delta("time_to_first_token_seconds_sum")
    assert sum(r["e2el_s"] for r in records) >= delta("e2e_request_latency_seconds_sum")
    with Image.open(plot_file) as image:
        image.verify()
        assert image.format == "PNG" and image.size == (1100, 800)


def locust(locustfile: str, *args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "locust", "-f", locustfile, *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_locust_master_and_two_workers(cluster, tmp_path: Path) -> None:
    locustfile, port = LOCUSTFILE, free_port()  # not imported here: locust would monkey-patch pytest
    # 6 s of load: each of the 4 users (2 per worker) sends requests of 8 tokens for the whole run after a 1 s
    # ramp, so each worker logs samples within its first second; what is checked (both workers' samples, the
    # CSV's counts agreeing, no failure) does not grow with the run's length, only its CPU time did (20 s).
    master = locust(locustfile, "--headless", "--master", "--master-bind-host", "127.0.0.1",
                    "--master-bind-port", str(port), "--expect-workers", "2", "--expect-workers-max-wait", "60",
                    "--host", cluster.target, "-u", "4", "-r", "4", "-t", "6s", "--csv", str(tmp_path / "run"),
                    "--input-len", "16", "--output-len", "8", "--ignore-eos", log=tmp_path / "master.log")
    workers = [locust(locustfile, "--worker", "--master-host", "127.0.0.1", "--master-port", str(port),
                      log=tmp_path / f"worker{i}.log") for i in range(2)]
    try:
        assert master.wait(timeout=120) == 0, (tmp_path / "master.log").read_text()[-3000:]
        for worker in workers:
            assert worker.wait(timeout=30) == 0
    finally:
        for process in (master, *workers):
            if process.poll() is None:
                process.kill()
    with open(tmp_path / "run_stats.csv") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    for name in ("TTFT", "TPOT", "E2EL"):
        assert rows[name]["Type"] == "grpc" and int(rows[name]["Request Count"]) > 0, rows
    assert rows["Aggregated"]["Failure Count"] == "0"
    assert int(rows["TTFT"]["Request Count"]) == int(rows["E2EL"]["Request Count"])
    with open(tmp_path / "run_failures.csv") as f:
        assert list(csv.DictReader(f)) == []
    # The master logged, per worker, the TTFT samples it received: both sent some, and together
    # they are the master's TTFT count.
    log = (tmp_path / "master.log").read_text()
    per_worker = json.loads(re.search(r"TTFT samples per worker: (\{.*\})", log).group(1))
    assert len(per_worker) == 2 and all(count > 0 for count in per_worker.values()), per_worker
    assert sum(per_worker.values()) == int(rows["TTFT"]["Request Count"])
