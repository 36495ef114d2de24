"""The summary table, the JSON file and the PNGs from synthetic runs; the CLI's argument errors."""

from __future__ import annotations

import json
import math

import pytest
from PIL import Image

from tpserve.bench.cli import parse_rates
from tpserve.bench.metrics import RequestRecord, summarize
from tpserve.bench.plot import plot_run, plot_sweep, tokens_over_time
from tpserve.bench.report import format_summary, format_sweep, write_result
from tpserve.bench.runner import RunResult
from launch.cli import main


def synthetic_run(rate: float, tpot_s: float, num_requests: int = 20) -> RunResult:
    records = []
    for i in range(num_requests):
        record = RequestRecord(index=i, start_s=0.1 * i, max_tokens=4)
        for k in range(4):
            record.add_chunk(0.05 + k * tpot_s, 1)
        record.finish("length", 8, 4)
        records.append(record)
    failed = RequestRecord(index=num_requests, start_s=0.0)
    failed.fail("RESOURCE_EXHAUSTED", "queue full")
    records.append(failed)
    return RunResult(rate, records, summarize(records, 0.1 * num_requests + 1.0, {"tpot": 15.0}))


def test_summary_table() -> None:
    run = synthetic_run(8.0, tpot_s=0.010)
    table = format_summary(run.summary, 8.0, 1.0, None)
    lines = table.splitlines()
    assert lines[0].startswith("=") and "Serving Benchmark Result" in lines[0] and set(lines[-1]) == {"="}
    assert "Successful requests:                    20" in table
    assert "  failed with RESOURCE_EXHAUSTED:       1\n    first message: queue full\n" in table
    assert "Request goodput (req/s):                6.67" in table  # 20 requests meet tpot <= 15 ms in 3 s
    assert "Mean TPOT (ms):                         10.00" in table
    assert "P99 ITL (ms):                           10.00" in table
    assert "Inter-token Latency (per token)" in table  # says what it is, and the tokens per message beside it
    assert "Mean tokens per message:                1.00" in table
    assert "Mean ITL per message (ms):              10.00" in table
    assert "Burstiness factor:                      1 (Poisson process)" in table


def test_result_file_is_strict_json(tmp_path) -> None:
    runs = [synthetic_run(2.0, 0.01), synthetic_run(math.inf, 0.02)]
    path = tmp_path / "out" / "result.json"
    write_result(path, {"num_prompts": 20}, runs)
    data = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"non-JSON constant {name}"))
    assert [run["request_rate"] for run in data["runs"]] == [2.0, "inf"]
    assert len(data["runs"][1]["requests"]) == 21
    assert data["runs"][1]["requests"][0]["tpot_s"] == pytest.approx(0.02)
    assert data["runs"][0]["summary"]["failures"] == {"RESOURCE_EXHAUSTED": 1}
    assert data["runs"][0]["summary"]["failure_messages"] == {"RESOURCE_EXHAUSTED": "queue full"}


def test_sweep_table_and_plot(tmp_path) -> None:
    runs = [synthetic_run(rate, tpot) for rate, tpot in ((1.0, 0.005), (4.0, 0.01), (math.inf, 0.03))]
    lines = format_sweep(runs).splitlines()
    assert len(lines) == 4 and lines[3].split()[0] == "inf" and lines[3].split()[4] == "30.00"
    plot_sweep(runs, tmp_path / "sweep.png", "sweep")
    with Image.open(tmp_path / "sweep.png") as image:
        image.verify()
        assert image.format == "PNG" and image.size == (1200, 500)


def test_run_plot_and_tokens_over_time(tmp_path) -> None:
    run = synthetic_run(8.0, tpot_s=0.010, num_requests=10)
    # Requests start every 0.1 s and stream 4 tokens from 0.05 to 0.08 s after their start.
    starts, rates, in_flight = tokens_over_time(run.records, bucket_s=0.1)
    assert len(starts) == 10 and rates == pytest.approx([40.0] * 10) and in_flight == [1] * 10
    plot_run(run, tmp_path / "run.png", "run")
    with Image.open(tmp_path / "run.png") as image:
        image.verify()
        assert image.format == "PNG" and image.size == (1100, 800)


def test_parse_rates() -> None:
    assert parse_rates("1,2.5, inf") == [1.0, 2.5, math.inf]
    for bad in ("", "1,x", "0,1", "-2"):
        with pytest.raises(ValueError, match="sweep-request-rate"):
            parse_rates(bad)


@pytest.mark.parametrize("argv, message", [
    (["--goodput", "itl:5"], "goodput"),
    (["--sweep-request-rate", "1,fast"], "sweep-request-rate"),
    (["--num-prompts", "0"], "num-prompts"),
    (["--seed", "-1"], "seed"),
    (["--dataset", "jsonl"], "dataset-path"),
])
def test_bad_arguments_exit_2_before_connecting(capsys, argv: list[str], message: str) -> None:
    assert main(["bench", "--target", "127.0.0.1:1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_exits_1_saying_why(capsys) -> None:
    """The reason was dropped: a wrong port or a TLS mismatch read "server not SERVING after 0 s"."""
    assert main(["bench", "--target", "127.0.0.1:1", "--ready-check-timeout-sec", "0.2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tpserve bench: 127.0.0.1:1: server not SERVING after 0.2 s; the last health check: ")
    assert "no tpserve server answers at 127.0.0.1:1" in err
